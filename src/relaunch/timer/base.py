"""The timer's moving parts: requests, clients, request queues, and the servers that reap.

``api`` (``configure``, ``expires``) and the two server/client pairs (``local_timer``,
``file_based_local_timer``) all build on these; this module imports none of them.
"""

from __future__ import annotations

import abc
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

from relaunch.core.workers.timers import Timer, TimerTable, reap_signal
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread

log = logging.getLogger(__name__)

#: How many requests one read takes, and how many reads of already-queued requests a wake-up
#: makes before it looks at the deadlines (so that a flood cannot starve the deadlines).
_BATCH = 1 << 16
_MAX_DRAINS = 64

#: Called with the worker and its expired timers just before the worker is reaped.
ReapHandler = Callable[[Any, list[Timer]], None]


class TimerRequest:
    """Acquire (or, with a negative ``expiration_time``, release) the timer of ``scope_id`` of
    ``worker_id``. What identifies a worker is up to each server/client pair (a pid here)."""

    __slots__ = ("expiration_time", "scope_id", "worker_id")

    def __init__(self, worker_id: Any, scope_id: str, expiration_time: float) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TimerRequest):
            return NotImplemented
        return (self.worker_id, self.scope_id, self.expiration_time) == (
            other.worker_id,
            other.scope_id,
            other.expiration_time,
        )

    def __hash__(self) -> int:
        return hash((self.worker_id, self.scope_id, self.expiration_time))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(worker_id={self.worker_id!r}, scope_id="
            f"{self.scope_id!r}, expiration_time={self.expiration_time!r})"
        )


class TimerClient(abc.ABC):
    """Acquires and releases countdown timers for the worker that holds it."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Start the timer of ``scope_id``: the worker may be reaped after ``expiration_time``."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Stop the timer of ``scope_id``."""


class RequestQueue(abc.ABC):
    """Where a server's requests arrive."""

    @abc.abstractmethod
    def size(self) -> int:
        """About how many requests wait now."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to ``size`` requests: blocks until ``size`` have arrived or ``timeout`` seconds
        pass (torch's meaning). The server asks for one, then takes what is queued with a
        timeout of 0."""

    def interrupt(self) -> None:  # noqa: B027 - a queue that cannot be woken returns on timeout
        """Make a blocked ``get`` return now (the server is stopping)."""


class TimerServer(abc.ABC):
    """Watches live timers and reaps the workers whose timers expire.

    The reaper thread sleeps until a request arrives or the next deadline comes, and at
    most ``max_interval`` seconds; ``stop()`` wakes it, so it returns at once. Deadlines are
    read from ``clock.time()``.
    """

    def __init__(
        self,
        request_queue: RequestQueue,
        max_interval: float,
        daemon: bool = True,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not max_interval > 0:
            raise ValueError(
                f"max_interval must be a positive number of seconds, got {max_interval!r}"
            )
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._clock = clock
        self._stop_event = threading.Event()
        self._reaper: threading.Thread | None = None
        self._last_pass: float | None = None  # when the reaper last went round its loop

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Apply acquire requests, and release requests (negative ``expiration_time``)."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Drop every timer of ``worker_ids``."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """The timers whose expiration time is at or before ``deadline``, by worker."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Any) -> bool:
        """Reap a worker whose timer expired; whether it was reaped."""

    def _next_deadline(self) -> float | None:
        """The earliest live deadline, when the server knows it (to sleep until then)."""
        return None

    def _reap_step(self) -> None:
        """Wait for requests or the next deadline, apply the requests, reap what expired."""
        timeout = self._max_interval
        next_deadline = self._next_deadline()
        if next_deadline is not None:
            timeout = max(0.0, min(timeout, next_deadline - self._clock.time()))
        requests = self._request_queue.get(1, timeout)
        for _ in range(_MAX_DRAINS):
            if self._stop_event.is_set():
                return
            self.register_timers(requests)
            # Everything already queued counts before any deadline is checked: a release that
            # came in time must win, however many requests arrived with it.
            requests = self._request_queue.get(_BATCH, 0)
            if not requests:
                break
        reaped = set()
        for worker_id, expired in self.get_expired_timers(self._clock.time()).items():
            log.info(
                "reaping worker %s: timer(s) %s expired",
                worker_id,
                ", ".join(repr(request.scope_id) for request in expired),
            )
            if self._reap_worker(worker_id):
                reaped.add(worker_id)
        if reaped:
            self.clear_timers(reaped)

    def _run_reaper(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._reap_step()
            except Exception:  # one bad request or reap must not end the reaper
                log.exception("timer server: error in the reaper loop (it goes on)")
            else:
                self._last_pass = self._clock.time()

    def get_last_progress_time(self) -> int:
        """When (``clock.time()``, whole seconds) the reaper last went round its loop, which
        it does at least every ``max_interval``; now if it has not yet (torch's liveness
        probe of its file timer server)."""
        last = self._last_pass
        return int(self._clock.time() if last is None else last)

    def start(self) -> None:
        """Start the reaper thread (returns at once); a server already started goes on, as
        torch's may be started again."""
        if self._reaper is not None:
            return
        self._stop_event.clear()
        self._reaper = start_thread(self._run_reaper, "relaunch-timer-reaper", daemon=self._daemon)

    def stop(self) -> None:
        """Stop the reaper thread, promptly."""
        self._stop_event.set()
        self._request_queue.interrupt()
        if self._reaper is not None:
            self._reaper.join()
            self._reaper = None


class TableTimerServer(TimerServer):
    """A server that keeps its timers in a ``TimerTable`` and reaps by signalling a pid.

    ``on_reap(worker_id, timers)`` hears of each reap before the signal is sent: the agent
    uses it to explain the worker's death. ``hand_over(worker_id, timers)``, when given, is
    sent the workers that would get the default signal (their requests named SIGKILL, the
    clients' default, or none) in place of that signal, and ends them itself: the agent asks
    them for their stacks first. A server never signals its own process.
    """

    #: The signal a reaped worker gets when its request named none.
    _default_signal: int = signal.SIGKILL

    def __init__(
        self,
        request_queue: RequestQueue,
        max_interval: float,
        daemon: bool = True,
        *,
        on_reap: ReapHandler | None = None,
        hand_over: ReapHandler | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(request_queue, max_interval, daemon, clock=clock)
        self._table = TimerTable()
        self._lock = threading.Lock()
        self._expired: dict[Any, list[Timer]] = {}
        self._on_reap = on_reap
        self._hand_over = hand_over
        self._last_activity: dict[Any, float] = {}

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        now = self._clock.time()
        with self._lock:
            for request in timer_requests:
                self._last_activity[request.worker_id] = now
                if request.expiration_time < 0:
                    self._table.release(request.worker_id, request.scope_id)
                    continue
                # A request may say when it was made (the file client's do) and which signal
                # reaps its worker; without, it counts from its arrival, with the default.
                acquired_at = min(getattr(request, "acquired_at", 0.0) or now, now)
                self._table.acquire(
                    request.worker_id,
                    request.scope_id,
                    request.expiration_time,
                    acquired_at,
                    getattr(request, "signal", 0),
                )

    def clear_timers(self, worker_ids: set[Any]) -> None:
        with self._lock:
            self._table.clear(worker_ids)
            for worker_id in worker_ids:
                self._expired.pop(worker_id, None)

    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        with self._lock:
            expired = self._table.expired(deadline)
            for worker_id, timers in expired.items():
                self._expired.setdefault(worker_id, []).extend(timers)
        return {
            worker_id: [TimerRequest(worker_id, t.scope, t.deadline) for t in timers]
            for worker_id, timers in expired.items()
        }

    def _next_deadline(self) -> float | None:
        with self._lock:
            return self._table.next_deadline()

    def last_activity(self, worker_id: Any) -> float | None:
        """When (``clock.time()``) ``worker_id`` last acquired or released a timer."""
        with self._lock:
            return self._last_activity.get(worker_id)

    def forget(self, worker_ids: Iterable[Any]) -> None:
        """Drop the timers and the activity of workers that are gone."""
        gone = set(worker_ids)
        self.clear_timers(gone)
        with self._lock:
            for worker_id in gone:
                self._last_activity.pop(worker_id, None)

    def _reap_worker(self, worker_id: Any) -> bool:
        with self._lock:
            timers = self._expired.pop(worker_id, [])
        pid = int(worker_id)
        if pid <= 1 or pid == os.getpid():
            log.error(
                "timer server: not reaping pid %d: it is %s",
                pid,
                "this process" if pid == os.getpid() else "not a worker",
            )
            return False
        if not self._may_reap(pid):
            log.warning("timer server: pid %d is not one of this agent's workers: not reaped", pid)
            return False
        sig = reap_signal(timers, self._default_signal)
        if sig <= 0:
            log.warning(
                "timer server: the timer of pid %d expired; its signal is %d, so it is not killed",
                pid,
                sig,
            )
            return True
        if sig == self._default_signal and self._hand_over is not None:
            self._hand_over(worker_id, timers)
            return True
        if self._on_reap is not None:
            self._on_reap(worker_id, timers)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass  # already gone
        except PermissionError:
            log.error("timer server: no permission to signal pid %d", pid)
            return False
        return True

    def _may_reap(self, pid: int) -> bool:
        return True
