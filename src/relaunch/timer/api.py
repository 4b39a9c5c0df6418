"""The timer API of the seed: requests, clients, servers, ``configure`` and ``expires``.

A worker says "this block must finish within N seconds" (``with expires(after=N):``); its client
sends an acquire request to a server in the agent, and a release when the block ends. A server
that sees a deadline pass reaps the worker. Server and client come in pairs that share a
message protocol: ``LocalTimerServer``/``LocalTimerClient`` over a multiprocessing queue,
``FileTimerServer``/``FileTimerClient`` over a named pipe.

Deadlines are ``time.time()`` seconds, a clock every process on a host shares.
"""

from __future__ import annotations

import abc
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from relaunch.core.timers import ENABLE_FILE_TIMER_ENV, TIMER_FILE_ENV, Timer, TimerTable
from relaunch.runtime import start_without_signals

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
        """Up to ``size`` requests: blocks until one arrives or ``timeout`` seconds pass."""

    def interrupt(self) -> None:  # noqa: B027 - a queue that cannot be woken returns on timeout
        """Make a blocked ``get`` return now (the server is stopping)."""


class TimerServer(abc.ABC):
    """Watches live timers and reaps the workers whose timers expire.

    The watchdog thread sleeps until a request arrives or the next deadline comes, and at
    most ``max_interval`` seconds; ``stop()`` wakes it, so it returns at once.
    """

    def __init__(
        self, request_queue: RequestQueue, max_interval: float, daemon: bool = True
    ) -> None:
        if not max_interval > 0:
            raise ValueError(
                f"max_interval must be a positive number of seconds, got {max_interval!r}"
            )
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._stop_event = threading.Event()
        self._watchdog: threading.Thread | None = None

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

    def _watchdog_step(self) -> None:
        timeout = self._max_interval
        next_deadline = self._next_deadline()
        if next_deadline is not None:
            timeout = max(0.0, min(timeout, next_deadline - time.time()))
        requests = self._request_queue.get(_BATCH, timeout)
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
        for worker_id, expired in self.get_expired_timers(time.time()).items():
            log.info(
                "reaping worker %s: timer(s) %s expired",
                worker_id,
                ", ".join(repr(request.scope_id) for request in expired),
            )
            if self._reap_worker(worker_id):
                reaped.add(worker_id)
        if reaped:
            self.clear_timers(reaped)

    def _run_watchdog(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._watchdog_step()
            except Exception:  # one bad request or reap must not end the watchdog
                log.exception("timer server: error in the watchdog loop (it goes on)")

    def start(self) -> None:
        """Start the watchdog thread (returns at once)."""
        if self._watchdog is not None:
            raise RuntimeError(f"{type(self).__name__} was already started")
        self._stop_event.clear()
        self._watchdog = threading.Thread(
            target=self._run_watchdog, daemon=self._daemon, name="relaunch-timer-watchdog"
        )
        start_without_signals(self._watchdog)

    def stop(self) -> None:
        """Stop the watchdog thread, promptly."""
        self._stop_event.set()
        self._request_queue.interrupt()
        if self._watchdog is not None:
            self._watchdog.join()
            self._watchdog = None


class TableTimerServer(TimerServer):
    """A server that keeps its timers in a ``TimerTable`` and reaps by signalling a pid.

    ``on_reap(worker_id, timers)`` hears of each reap before the signal is sent: the agent
    uses it to explain the worker's death. A server never signals its own process.
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
    ) -> None:
        super().__init__(request_queue, max_interval, daemon)
        self._table = TimerTable()
        self._lock = threading.Lock()
        self._expired: dict[Any, list[Timer]] = {}
        self._on_reap = on_reap
        self._last_activity: dict[Any, float] = {}

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        now = time.time()
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
        """When (``time.time()``) ``worker_id`` last acquired or released a timer."""
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
        sig = next((t.signal for t in timers if t.signal), 0) or self._default_signal
        if sig <= 0:
            log.warning(
                "timer server: the timer of pid %d expired; its signal is %d, so it is not killed",
                pid,
                sig,
            )
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


_client: TimerClient | None = None


def configure(timer_client: TimerClient) -> None:
    """Make ``timer_client`` the one ``expires`` uses when it is given none."""
    global _client
    _client = timer_client


def _configured_client() -> TimerClient:
    if _client is not None:
        return _client
    path = os.environ.get(TIMER_FILE_ENV)
    if path:
        from relaunch.timer.file_based_local_timer import FileTimerClient

        configure(FileTimerClient(path))
        assert _client is not None
        return _client
    raise RuntimeError(
        "relaunch.timer.expires: no timer client is configured: call "
        "relaunch.timer.configure(client), or run under `relaunch --timers` (or "
        f"{ENABLE_FILE_TIMER_ENV}=1), which sets {TIMER_FILE_ENV}"
    )


def _caller_scope() -> str:
    frame = sys._getframe(3)  # the caller of the ``with``, past contextmanager's frames
    return f"{frame.f_code.co_filename}#{frame.f_lineno}"


@contextmanager
def expires(
    after: float, scope: str | None = None, client: TimerClient | None = None
) -> Iterator[None]:
    """``with expires(after=60):``: the worker may be reaped if the block runs past 60 s.

    ``scope`` names the timer (by default the caller's ``file#line``); ``client`` defaults to
    the configured one, or under ``relaunch --timers`` to the agent's file timer server.
    """
    if (
        isinstance(after, bool)
        or not isinstance(after, (int, float))
        or not (after > 0 and math.isfinite(after))
    ):
        raise ValueError(f"expires(after={after!r}): expected a positive number of seconds")
    timer_client = client or _configured_client()
    scope_id = scope if scope is not None else _caller_scope()
    timer_client.acquire(scope_id, time.time() + after)
    try:
        yield
    finally:
        timer_client.release(scope_id)
