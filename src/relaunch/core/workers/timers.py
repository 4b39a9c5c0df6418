"""The expiry table behind ``relaunch.timer``: which scopes of which workers are due, and when.

Pure bookkeeping: callers pass ``now`` (the clock the requests' deadlines use) and get data
back. Acquire and release are O(log n) and O(1); ``expired(now)`` costs O(log n) per timer it
returns, and ``next_deadline()`` O(1) amortised, so a server can sleep exactly until the next
deadline instead of waking on a period.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from typing import TypeVar

from relaunch.core.durations import seconds
from relaunch.core.value import Value

K = TypeVar("K")

#: The agent's switch for the file timer server (torchrun's variable), and the FIFO it gives
#: workers.
ENABLE_FILE_TIMER_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"


class Timer(Value):
    """A live countdown: ``worker`` must leave ``scope`` by ``deadline``."""

    __slots__ = ("acquired_at", "deadline", "scope", "signal", "worker")

    worker: Hashable
    scope: str
    deadline: float
    #: When the timer was acquired (by the table's clock), to say how long it was held.
    acquired_at: float
    #: What the worker asked to be sent when the timer expires (0: the server's choice).
    signal: int

    def __init__(
        self, worker: Hashable, scope: str, deadline: float, acquired_at: float, signal: int = 0
    ) -> None:
        self._set(
            worker=worker, scope=scope, deadline=deadline, acquired_at=acquired_at, signal=signal
        )

    @property
    def allowed(self) -> float:
        """The seconds the worker gave itself."""
        return self.deadline - self.acquired_at


class TimerTable:
    """Live timers by (worker, scope); a scope acquired again replaces its timer."""

    def __init__(self) -> None:
        self._live: dict[tuple[Hashable, str], Timer] = {}
        # Entries stay in the heap after a release; they are skipped when their timer is gone.
        self._heap: list[tuple[float, int, Timer]] = []
        self._pushed = 0

    def __len__(self) -> int:
        return len(self._live)

    def acquire(
        self, worker: Hashable, scope: str, deadline: float, now: float, signal: int = 0
    ) -> Timer:
        """Start (or move) the timer of ``scope`` of ``worker``."""
        timer = Timer(worker, scope, deadline, now, signal)
        self._live[(worker, scope)] = timer
        self._pushed += 1
        heapq.heappush(self._heap, (deadline, self._pushed, timer))
        self._compact()
        return timer

    def release(self, worker: Hashable, scope: str) -> bool:
        """Stop the timer of ``scope`` of ``worker``; whether there was one."""
        return self._live.pop((worker, scope), None) is not None

    def clear(self, workers: Iterable[Hashable]) -> int:
        """Drop every timer of ``workers``; how many there were."""
        gone = set(workers)
        keys = [key for key in self._live if key[0] in gone]
        for key in keys:
            del self._live[key]
        return len(keys)

    def workers(self) -> set[Hashable]:
        """The workers that hold at least one timer."""
        return {worker for worker, _ in self._live}

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live timer, or None when there is none."""
        self._drop_stale_top()
        return self._heap[0][0] if self._heap else None

    def expired(self, now: float) -> dict[Hashable, list[Timer]]:
        """Remove and return the timers due at ``now`` (deadline <= now), by worker."""
        due: dict[Hashable, list[Timer]] = {}
        while True:
            self._drop_stale_top()
            if not self._heap or self._heap[0][0] > now:
                return due
            _, _, timer = heapq.heappop(self._heap)
            del self._live[(timer.worker, timer.scope)]
            due.setdefault(timer.worker, []).append(timer)

    def _is_live(self, timer: Timer) -> bool:
        return self._live.get((timer.worker, timer.scope)) is timer

    def _drop_stale_top(self) -> None:
        while self._heap and not self._is_live(self._heap[0][2]):
            heapq.heappop(self._heap)

    def _compact(self) -> None:
        """Rebuild the heap when released timers make up most of it (bounded memory)."""
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._live):
            self._heap = [entry for entry in self._heap if self._is_live(entry[2])]
            heapq.heapify(self._heap)


def reap_signal(timers: Iterable[Timer], default: int) -> int:
    """The signal a worker whose ``timers`` expired is reaped with: the first one a timer
    named, else ``default`` (zero or negative: it is only reported)."""
    return next((timer.signal for timer in timers if timer.signal), 0) or default


def expired_line(timers: Iterable[Timer]) -> str:
    """What expired, for a report: ``expiry timer 'step' expired: the block was given 60s``."""
    return "; ".join(
        f"expiry timer {timer.scope!r} expired: the block was given {seconds(timer.allowed)}"
        for timer in timers
    )


def silent(last_sign: dict[K, float], now: float, timeout: float) -> tuple[list[K], float | None]:
    """The workers that showed no sign of life for ``timeout`` seconds at ``now``, and the
    earliest moment another one could (None when every worker is already silent)."""
    hung = [worker for worker, seen in last_sign.items() if now - seen >= timeout]
    waiting = [seen + timeout for worker, seen in last_sign.items() if now - seen < timeout]
    return hung, min(waiting, default=None)
