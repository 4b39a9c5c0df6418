"""The agent's parking lot: where ranks restarting in place (``relaunch.in_place``) wait.

A Unix ``SOCK_SEQPACKET`` socket in the workers' channel directory, mode 0600. A worker running
a ``@relaunch.restart_in_place`` function connects once; the connection says it can wait. Peers
are known by their pid (``SO_PEERCRED``); the only thing a worker may say is ``parked``, and
anything else closes its connection with one line in the agent's log. Only the agent's current
workers may park: a park from any other process (a worker's helper that inherited the
environment) is refused, changing nothing, and its exception stands.

A rank parks when its function raised. The agent keeps it while a stop for a failure is under
way (``explain``: a worker of this node failed, or the job restarts for a failure elsewhere) and
hands it the next attempt (``resume``). A park that nothing explains within ``PARK_WAIT``
seconds is the rank's own exception: the first rank parked is told ``go on`` and fails with it.
Only a failure the agent sees explains a park: the others wait on while the rank told to go on
lives (at most another ``PARK_WAIT``), and ``PARK_WAIT`` more once it ended, for its failure, if
it failed, to explain them; then they too are told to go on. One thread serves the lot (a
``server_loop``): the listener and the connections, with the unexplained park's deadline as a
timer.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import signal
import struct
import threading
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from relaunch.in_place import GO_ON, MAX_MESSAGE, PARKED, PARKING_ENV, RESUME
from relaunch.procs.guardian import guardian
from relaunch.procs.handles import PopenHandle, ProcessHandle, signal_tree
from relaunch.procs.monitor import KILL_DEADLINE
from relaunch.procs.worker_process import FailureGrace
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.server_loop import Listener, ServerLoop, Timer, adopt, bind_unix

if TYPE_CHECKING:
    import socket  # loaded as the lot is served (``serve``), after the workers started

log = logging.getLogger(__name__)

#: Seconds, at least, that a park waits for a failure or a restart to explain it before the rank
#: is told to go on (its exception was its own), and that a stop for a failure waits for the
#: ranks to park: two of their steps where these are longer (``park_wait``). A peer's death
#: breaks a collective at once, or at the next one; the agents hear of it within a tick.
PARK_WAIT = 2.0


def park_wait(step_seconds: float) -> float:
    """How long parks are waited for, in a job whose slowest rank steps every
    ``step_seconds`` (0: not known)."""
    return max(PARK_WAIT, 2 * step_seconds)


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def parking_path(channel_path: str) -> str:
    """Where the lot of the workers whose channel is ``channel_path`` listens: beside it."""
    return f"{channel_path}.park"


class ParkingLot:
    """Serves the ranks of one agent that can restart in place; ``on_park(pid)`` is called
    when one parks while a stop for a failure is under way (from the lot's thread), or for
    every one parked when it begins (``explain``, from its caller's). ``workers()`` gives the
    pids of the agent's workers now (called from the lot's thread): only those may park."""

    def __init__(
        self,
        path: str,
        on_park: Callable[[int], None],
        workers: Callable[[], Collection[int]],
        wait: Callable[[], float] = lambda: PARK_WAIT,
        *,
        clock: Clock = SYSTEM_CLOCK,
        serve: bool = True,
    ) -> None:
        self.path = path
        self._on_park = on_park
        self._workers = workers
        self.wait = wait
        self._clock = clock
        #: Listening from here on; a socket once served (``serve``).
        self._listener: int | socket.socket = bind_unix(path, 64)
        guardian().register_file(path)
        self._lock = threading.Condition()
        self._connections: dict[int, socket.socket] = {}  # pid -> its connection
        self._parked: dict[int, float] = {}  # pid -> when it parked
        self._explained = False
        #: Parks of pids not known as workers while an attempt starts (``starting``): judged
        #: once its workers are (``new_attempt``). pid -> when it parked.
        self._unknown: dict[int, float] = {}
        self._starting = False
        #: Ranks told to go on, still connected: pid -> until when the others' parks wait for
        #: its end; and until when they wait, one of them having ended.
        self._going_on: dict[int, float] = {}
        self._held_until = 0.0
        #: Parks refused since the last summary: how many, and the first few pids.
        self._refused = 0
        self._refused_pids: list[int] = []
        self._closing = False
        self._loop = ServerLoop(clock)
        self._loop.after_events = self._tend
        self._due: Timer | None = None  # the unexplained park's deadline
        if serve:
            self.serve()

    def serve(self) -> None:
        """Start the lot's thread (once): till then a worker's connection waits in the backlog,
        so an agent starts it after its workers, off their start-up's path."""
        if self._loop.thread is None:
            assert isinstance(self._listener, int), "served once"
            self._listener = adopt(self._listener)
            Listener(self._loop, self._listener, self._accept, name="parking lot", per_turn=1)
            self._loop.start("relaunch-parking")

    def env(self) -> dict[str, str]:
        return {PARKING_ENV: self.path}

    # -- the agent's side ------------------------------------------------------------------

    def can_park(self, pids: Collection[int]) -> set[int]:
        """Those of ``pids`` connected to the lot: they park rather than exit when they fail."""
        with self._lock:
            return {pid for pid in pids if pid in self._connections}

    def parkable(self, pids: Mapping[int, int], ranks: Collection[int]) -> dict[int, int]:
        """Those of the local ``ranks`` (whose pids ``pids`` gives) that can park, with their
        pids."""
        connected = self.can_park([pids[rank] for rank in ranks if rank in pids])
        return {rank: pids[rank] for rank in ranks if pids.get(rank) in connected}

    def parked(self) -> set[int]:
        with self._lock:
            return set(self._parked)

    def explain(self) -> None:
        """A stop for a failure is under way: parks are kept (``on_park``, for those parked
        already too), not told to go on."""
        with self._lock:
            self._explained = True
            parked = sorted(self._parked, key=self._parked.__getitem__)
        for pid in parked:
            self._on_park(pid)

    def starting(self) -> None:
        """An attempt's workers are being started: a park from a pid not known yet waits for
        ``new_attempt`` to be judged."""
        with self._lock:
            self._starting = True

    def new_attempt(self) -> None:
        """An attempt started (its kept ranks resumed, its workers known): a park must be
        explained afresh."""
        with self._lock:
            self._explained = False
            self._starting = False
            self._going_on.clear()
            self._held_until = 0.0
            self._summarise_refusals_locked()
        self._wake()  # the lot's thread judges the parks of pids that were not known

    def wait_parked(self, pids: Collection[int], timeout: float) -> set[int]:
        """Wait up to ``timeout`` seconds for every one of ``pids`` still connected to park;
        those parked."""
        deadline = self._clock.monotonic() + timeout
        with self._lock:
            while True:
                waiting = [pid for pid in pids if pid in self._connections]
                if all(pid in self._parked for pid in waiting):
                    break
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            return {pid for pid in pids if pid in self._parked}

    def resume(
        self, pid: int, env: Mapping[str, str], stdout: int | None, stderr: int | None
    ) -> bool:
        """Hand the parked ``pid`` its next attempt: ``env`` (all of it), writing to
        ``stdout``/``stderr`` (None: the agent's own). False when it is no longer there."""
        with self._lock:
            connection = self._connections.get(pid)
            if connection is None or self._parked.pop(pid, None) is None:
                return False
        text = "\0".join(f"{key}={value}" for key, value in env.items())
        message = RESUME + text.encode("utf-8", "surrogateescape")
        fds = [1 if stdout is None else stdout, 2 if stderr is None else stderr]
        try:
            if len(message) > MAX_MESSAGE:
                raise OSError(f"its environment is over {MAX_MESSAGE} bytes")
            import socket  # served: loaded

            socket.send_fds(connection, [message], fds)
        except OSError as exc:
            log.warning("cannot hand pid %d its attempt (%s): it starts afresh", pid, exc)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            self._summarise_refusals_locked()
            self._closing = True
            connections = list(self._connections.values())
            self._connections.clear()
            self._parked.clear()
        self._loop.stop()
        for connection in connections:
            connection.close()
        if isinstance(self._listener, int):
            os.close(self._listener)
        else:
            self._listener.close()
        self._loop.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        guardian().unregister_file(self.path)

    # -- the lot's thread ------------------------------------------------------------------

    def _wake(self) -> None:
        self._loop.wake()

    def _tend(self) -> None:
        """Each turn: judge the parks of pids not known before, and time the next go on."""
        with self._lock:
            if self._closing:
                return
            judge = bool(self._unknown) and not self._starting
        if judge:
            self._judge_unknown()
        with self._lock:
            timeout = self._go_on_due()
        if self._due is not None:
            self._due.cancel()
        # A turn at the deadline (this one again: the timer itself does nothing).
        self._due = None if timeout is None else self._loop.call_later(timeout, lambda: None)

    def _go_on_due(self) -> float | None:
        """Tell the first unexplained park to go on once ``PARK_WAIT`` has passed, and no rank
        told so before may yet fail and explain it; the seconds until the next such deadline
        (None: none)."""
        if self._explained or not self._parked:
            return None
        pid, parked_at = min(self._parked.items(), key=lambda item: item[1])
        wait = self.wait()
        due = max(parked_at + wait, self._held_until, *self._going_on.values())
        now = self._clock.monotonic()
        if due > now:
            return due - now
        del self._parked[pid]
        connection = self._connections.get(pid)
        if connection is not None:
            log.warning("pid %d parked with no failure to explain it: its exception stands", pid)
            self._going_on[pid] = now + wait
            try:
                connection.send(GO_ON)
            except OSError:
                pass
        return 0.0 if self._parked else None

    def _accept(self, connection: socket.socket, address: object) -> None:
        import socket  # served: loaded

        credentials = connection.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size
        )
        pid, uid, _ = _CREDENTIALS.unpack(credentials)
        if uid != os.getuid():
            log.warning("the parking lot refused pid %d of another user (uid %d)", pid, uid)
            connection.close()
            return
        connection.setblocking(False)
        with self._lock:
            old = self._connections.pop(pid, None)
            self._connections[pid] = connection
        if old is not None:
            self._forget(old)
        self._loop.register(
            connection, selectors.EVENT_READ, lambda mask: self._read(connection, pid)
        )

    def _read(self, connection: socket.socket, pid: int) -> None:
        try:
            message = connection.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            message = b""
        if message == PARKED:
            worker = pid in self._workers()
            with self._lock:
                if self._connections.get(pid) is not connection:
                    return
                self._going_on.pop(pid, None)
                if not worker and self._starting:
                    self._unknown[pid] = self._clock.monotonic()
                    return
                if not worker:
                    self._refuse_locked(pid)
                    return
                self._parked[pid] = self._clock.monotonic()
                self._lock.notify_all()
                explained = self._explained
            if explained:
                self._on_park(pid)
            return
        if message:
            log.warning("the parking lot closed pid %d's connection: it said %r", pid, message[:32])
        with self._lock:
            if self._connections.get(pid) is connection:
                del self._connections[pid]
                self._parked.pop(pid, None)
                self._unknown.pop(pid, None)
                if self._going_on.pop(pid, None) is not None:
                    # It ended: its failure, if it failed, explains the others' parks once the
                    # agent has seen it.
                    self._held_until = max(self._held_until, self._clock.monotonic() + self.wait())
                self._lock.notify_all()
        self._forget(connection)

    def _judge_unknown(self) -> None:
        """The attempt's workers are known: the parks made before, of those, count from when
        they were made; the others' are refused."""
        workers = set(self._workers())
        with self._lock:
            unknown, self._unknown = self._unknown, {}
            for pid, parked_at in unknown.items():
                if pid in workers and pid in self._connections:
                    self._parked[pid] = parked_at
                else:
                    self._refuse_locked(pid)
            self._lock.notify_all()
            explained = [pid for pid in unknown if pid in self._parked] if self._explained else []
        for pid in explained:
            self._on_park(pid)

    def _refuse_locked(self, pid: int) -> None:
        """A park from ``pid``, not a worker of the agent's: its connection closed (its exception
        stands), nothing else changed; said once an attempt, the rest counted."""
        connection = self._connections.pop(pid, None)
        if connection is not None:
            self._forget(connection)
        if not self._refused:
            log.warning(
                "the parking lot refused pid %d: it is not a worker of this attempt (a worker's "
                "helper process?); its exception stands",
                pid,
            )
        elif len(self._refused_pids) < 5:
            self._refused_pids.append(pid)
        self._refused += 1

    def _summarise_refusals_locked(self) -> None:
        if self._refused > 1:
            more = ", ..." if self._refused > 1 + len(self._refused_pids) else ""
            log.warning(
                "the parking lot refused %d more process(es) that are not workers (pids %s%s)",
                self._refused - 1,
                ", ".join(map(str, self._refused_pids)),
                more,
            )
        self._refused, self._refused_pids = 0, []

    def _forget(self, connection: socket.socket) -> None:
        self._loop.unregister(connection)
        connection.close()


class Parked:
    """A worker kept to restart in place (``procs.base.Resume``): its handle, and the lot it
    waits in."""

    def __init__(self, handle: PopenHandle | ProcessHandle, lot: ParkingLot) -> None:
        self.handle, self._lot = handle, lot

    def resume(self, env: dict[str, str], stdout: int | None, stderr: int | None) -> bool:
        if self._lot.resume(self.handle.pid, env, stdout, stderr):
            return True
        let_go(self.handle)  # it died while it waited: its rank starts afresh
        return False


def let_go(handle: PopenHandle | ProcessHandle) -> None:
    """End a kept worker no attempt takes (the run is over, or it cannot take its attempt)."""
    signal_tree(handle.pid, signal.SIGKILL)
    if handle.wait(KILL_DEADLINE) is None:
        log.warning("kept worker %d did not die within %gs of SIGKILL", handle.pid, KILL_DEADLINE)
        handle.abandon()
    guardian().unregister(handle.pid)
    handle.release()


class ParkGrace(FailureGrace):
    """A worker of this node failed: the stop of those that can park (``ParkingLot.can_park``)
    waits up to the lot's ``wait()`` seconds for them to park, each kept as it does."""

    def __init__(self, lot: ParkingLot, pids: Callable[[], Mapping[int, int]]) -> None:
        self._lot, self._pids = lot, pids
        self._waiting: set[int] = set()
        self._release: Callable[[], None] | None = None

    def begin(self, running: set[int], release: Callable[[], None]) -> float:
        self._waiting = set(self._lot.parkable(self._pids(), running))
        if not self._waiting:
            return 0.0
        self._release = release
        self._lot.explain()
        return self._lot.wait()

    def exited(self, local_rank: int) -> None:
        self._waiting.discard(local_rank)
        if not self._waiting and self._release is not None:
            release, self._release = self._release, None
            release()


class Graces(FailureGrace):
    """Several graces at once: the stop waits for the longest, until each has released it."""

    def __init__(self, *graces: FailureGrace) -> None:
        self._graces = graces

    def begin(self, running: set[int], release: Callable[[], None]) -> float:
        holding: set[int] = set()
        begun = False

        def released(index: int) -> None:
            holding.discard(index)
            if begun and not holding:
                release()

        hold = 0.0
        for index, grace in enumerate(self._graces):
            holding.add(index)
            seconds = grace.begin(running, functools.partial(released, index))
            if seconds > 0:
                hold = max(hold, seconds)
            else:
                holding.discard(index)
        begun = True
        return hold if holding else 0.0

    def exited(self, local_rank: int) -> None:
        for grace in self._graces:
            grace.exited(local_rank)
