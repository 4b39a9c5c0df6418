"""The state peers' TCP server (``agent.state_peers``): a thread a connection, accepted by a
``server_loop``, bounded for whoever reaches its port, member or not.

At most ``MAX_CONNECTIONS`` connections are served at once, and at most ``MAX_UNPROVEN`` of them
have not proved the job's key yet: when that many wait, a newcomer takes the place of the oldest
if that one has had ``HANDSHAKE_GRACE`` seconds, or waits in the kernel's queue until it has
(as the built-in store does); the one closed to make room counts until its thread has ended, so
that threads never outnumber the cap. A connection has ``HANDSHAKE_TIMEOUT`` seconds from its
accept, all reads together, to prove the key and make its request; only then is it read with
``IO_TIMEOUT`` a read. Out of descriptors (``EMFILE``) or threads, the accept loop rests
``ACCEPT_BACKOFF`` seconds and goes on (one line per episode); the connection that found no
thread is closed. Refused connections are logged as the store's are (``store.refusals``): the
first in full, the others summed up in one line per ``REFUSAL_SUMMARY_INTERVAL`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from relaunch.runtime import start_thread
from relaunch.server_loop import Listener, ServerLoop
from relaunch.store.refusals import Refusals

log = logging.getLogger(__name__)

#: Seconds any one read or write of a connection that proved the key may take.
IO_TIMEOUT = 30.0
#: Seconds a connection has, from its accept, to prove the key and make its request.
HANDSHAKE_TIMEOUT = 3.0
#: Connections served at once (a thread each), at most ...
MAX_CONNECTIONS = 64
#: ... of which this many at most have not proved the key yet ...
MAX_UNPROVEN = 32
#: ... each given this many seconds before a newcomer may take its place.
HANDSHAKE_GRACE = 1.0
#: Out of descriptors or threads, the listener rests this long.
ACCEPT_BACKOFF = 0.5
#: Refused connections after the first are summed up in one log line per this many seconds.
REFUSAL_SUMMARY_INTERVAL = 10.0
#: Connections accepted per turn of the accept loop, at most.
_ACCEPTS_PER_TURN = 64

Request = TypeVar("Request")


class Refused(Exception):
    """A connection to close unserved: ``reason`` sums it up, ``detail`` says it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class PeerServer(Generic[Request]):
    """Serves each connection to ``host`` (a port of its own) in a thread of its own:
    ``handshake(connection, deadline)`` proves the peer and reads its request (``Refused``,
    ``OSError`` or ``ValueError`` when it cannot), then ``serve(connection, peer, request)``."""

    def __init__(
        self,
        host: str,
        handshake: Callable[[socket.socket, float], Request],
        serve: Callable[[socket.socket, str, Request], None],
    ) -> None:
        self._handshake, self._serve_request = handshake, serve
        listener = socket.create_server((host, 0))
        self.address = f"{host}:{listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._unproven: dict[socket.socket, float] = {}  # -> when accepted; oldest first
        self._evicted: set[socket.socket] = set()  # closed to make room for newer ones
        self._threads: list[threading.Thread] = []  # the connections' (ended ones pruned)
        self._refusals = Refusals(REFUSAL_SUMMARY_INTERVAL, "state peers", log)
        self._closing = False
        self._short: str | None = None  # what accepting runs short of, in an episode
        self._backoff_until = 0.0
        self._loop = ServerLoop()
        self._loop.on_end = self._release
        self._listener = Listener(
            self._loop, listener, self._accept, name="state peers", admit=self._admit,
            per_turn=_ACCEPTS_PER_TURN, on_error=self._accept_failed, recovered=self._recovered,
        )  # fmt: skip
        self._accepter = self._loop.start("relaunch-state-peers")

    @property
    def refused(self) -> int:
        """Connections refused so far (for tests and metrics)."""
        with self._lock:
            return self._refusals.total

    def serving(self) -> tuple[int, int]:
        """Connections open now, and those of them that have not proved the key."""
        with self._lock:
            return len(self._open), len(self._unproven)

    def refuse(self, peer: str, refused: Refused) -> None:
        """Log ``peer``'s connection as refused (summed up with the others)."""
        with self._lock:
            self._refusals.note(peer, refused.reason, refused.detail, time.monotonic())
        self._loop.call_soon(self._time_summary)  # the summary's interval may have begun

    def close(self) -> None:
        """Stop accepting, end every connection, and wait for the accept loop and the
        connections' threads (each read or write of theirs ends at once or in ``IO_TIMEOUT``)."""
        with self._lock:
            self._closing = True
            for connection in self._open:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        self._loop.stop()  # after its last start of a thread
        self._loop.close()
        with self._lock:
            threads = list(self._threads)
        deadline = time.monotonic() + IO_TIMEOUT
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- the accept loop ------------------------------------------------------------------

    def _release(self) -> None:
        """The accept loop's end: the listener closed, the refusals summed up."""
        self._listener.sock.close()
        with self._lock:
            self._refusals.flush()

    def _time_summary(self) -> None:
        with self._lock:
            self._refusals.timed(self._loop, self._lock)

    def _admit(self, now: float) -> bool:
        """Whether a newcomer may be accepted now; else the listener rests (until a
        connection ends or proves the key, or the oldest unproven one has had its grace)."""
        with self._lock:
            if self._closing:
                return False
            room, until = self._room(now)
        if not room:
            self._listener.rest(until)
        return room

    def _room(self, now: float) -> tuple[bool, float | None]:
        """Whether a newcomer may be accepted now (the lock held), making room for it among
        the unproven when their oldest has had its grace; else when to look again (None: when
        a connection ends)."""
        if len(self._open) >= MAX_CONNECTIONS:
            return False, None
        # An evicted connection holds its thread until that sees the end: it counts until then.
        if len(self._unproven) + len(self._evicted) < MAX_UNPROVEN:
            return True, None
        if not self._unproven:
            return False, None
        oldest, accepted = next(iter(self._unproven.items()))
        if now - accepted < HANDSHAKE_GRACE:
            return False, accepted + HANDSHAKE_GRACE
        del self._unproven[oldest]
        self._evicted.add(oldest)
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread sees the end, says why, and resumes us
        return False, None

    def _accept(self, connection: socket.socket, address: tuple[str, int]) -> None:
        self._start(connection, f"{address[0]}:{address[1]}", time.monotonic())

    def _resume(self) -> None:
        """A connection ended or proved the key: a newcomer may fit (not while backing off)."""
        if time.monotonic() >= self._backoff_until:
            self._listener.resume()

    def _accept_failed(self, exc: OSError) -> bool:
        """Out of descriptors, most likely: rest a while (the others are still served)."""
        self._run_short(exc.strerror or str(exc))
        return False

    def _recovered(self) -> None:
        if self._short is not None:  # nobody waits any more: the shortage is over
            self._short = None
            log.info("state peers: accepting connections again")

    def _start(self, connection: socket.socket, peer: str, now: float) -> bool:
        """Serve ``connection`` in a thread of its own; whether one could start."""
        connection.setblocking(True)
        with self._lock:
            if self._closing:
                connection.close()
                return False
            self._open.add(connection)
            self._unproven[connection] = now
        try:
            thread = start_thread(self._serve, "relaunch-state-peer", connection, peer, now)
        except RuntimeError as exc:  # can't start new thread: this one closed, the others go on
            with self._lock:
                self._open.discard(connection)
                self._unproven.pop(connection, None)
            connection.close()
            self.refuse(peer, Refused("found no thread", f"no thread to serve it ({exc})"))
            self._run_short(str(exc))
            return False
        with self._lock:
            if len(self._threads) >= 2 * MAX_CONNECTIONS:
                self._threads = [alive for alive in self._threads if alive.is_alive()]
            self._threads.append(thread)
        return True

    def _run_short(self, what: str) -> None:
        """Accepting failed for want of ``what``: rest the listener a while; said once an
        episode."""
        if self._short is None:
            with self._lock:
                count = len(self._open)
            log.warning(
                "state peers: cannot accept more connections (%s) with %d open: new ones wait "
                "until some close; raise the open-file limit (ulimit -n, systemd LimitNOFILE) "
                "or the task limit (ulimit -u, TasksMax)",
                what,
                count,
            )
        self._short = what
        self._listener.shortage = True  # its end is told to ``_recovered``
        self._backoff_until = time.monotonic() + ACCEPT_BACKOFF
        self._listener.rest(self._backoff_until)

    # -- a connection ---------------------------------------------------------------------

    def _serve(self, connection: socket.socket, peer: str, accepted: float) -> None:
        try:
            try:
                request = self._handshake(connection, accepted + HANDSHAKE_TIMEOUT)
            except Refused as refused:
                self.refuse(peer, refused)
                return
            except (OSError, ValueError) as exc:
                self.refuse(peer, self._unproven_end(connection, accepted, exc))
                return
            with self._lock:
                proven = self._unproven.pop(connection, None) is not None
            self._loop.call_soon(self._resume)
            if not proven:  # made room for a newer one just as it proved the key
                self.refuse(peer, self._unproven_end(connection, accepted, None))
                return
            connection.settimeout(IO_TIMEOUT)
            self._serve_request(connection, peer, request)
        except (OSError, ValueError) as exc:
            log.debug("state peers: the connection of %s ended: %s", peer, exc)
        finally:
            with self._lock:  # then nobody shuts it down: its descriptor may be reused
                self._open.discard(connection)
                self._unproven.pop(connection, None)
                self._evicted.discard(connection)
            connection.close()
            self._loop.call_soon(self._resume)  # last: the thread ends right after

    def _unproven_end(
        self, connection: socket.socket, accepted: float, exc: BaseException | None
    ) -> Refused:
        """Why a connection ended before it proved the key."""
        with self._lock:
            evicted = connection in self._evicted
        age = time.monotonic() - accepted
        if evicted:
            return Refused(
                "made room for newer ones",
                f"no proof of the job's key after {age:.1f}s, with {MAX_UNPROVEN} connections "
                "waiting to prove it: made room for a newer one",
            )
        if isinstance(exc, TimeoutError) or age >= HANDSHAKE_TIMEOUT:
            return Refused(
                "no proof in time", f"no proof of the job's key within {HANDSHAKE_TIMEOUT:g}s"
            )
        return Refused("ended before a proof", f"ended before it proved the job's key ({exc})")
