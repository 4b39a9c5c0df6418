"""Workers' progress as the agent reads it from the channel, and the per-node bar it draws."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from relaunch.core.channel import DESC_END, DESC_OFFSET, FIELDS, SEQ, slot_offset
from relaunch.core.value import Value

#: Seconds of history the rate is computed over.
RATE_WINDOW = 10.0
BAR_WIDTH = 20


class Progress(Value):
    """One worker's last report."""

    __slots__ = ("desc", "reports", "step", "time", "total")

    step: int
    total: int | None
    time: float
    desc: str
    #: How many reports the worker made (the seqlock's count): growth is a sign of life.
    reports: int

    def __init__(self, step: int, total: int | None, time: float, desc: str, reports: int) -> None:
        self._set(step=step, total=total, time=time, desc=desc, reports=reports)


def read_progress(
    buffer: bytes | bytearray | memoryview, rank: int, tries: int = 8
) -> Progress | None:
    """The last progress report of ``rank``; None before its first (or if always torn)."""
    offset = slot_offset(rank)
    for _ in range(tries):
        (before,) = SEQ.unpack_from(buffer, offset)
        if before == 0:
            return None
        if before % 2:
            continue  # the worker is writing
        step, total, when = FIELDS.unpack_from(buffer, offset + 8)
        desc = bytes(buffer[offset + DESC_OFFSET : offset + DESC_END]).split(b"\0", 1)[0]
        (after,) = SEQ.unpack_from(buffer, offset)
        if after == before:
            return Progress(
                step,
                None if total < 0 else total,
                when,
                desc.decode("utf-8", errors="replace"),
                before // 2,
            )
    return None


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _rate(rate: float) -> str:
    return f"{rate:.3g} step/s" if rate >= 1 else f"{1 / rate:.3g} s/step" if rate > 0 else "?"


class NodeProgress:
    """The slowest local rank's step over the total, with rate and ETA, from the latest reports
    of every rank; ``line(now)`` renders it (None before any report)."""

    def __init__(self, started_at: float) -> None:
        self._started_at = started_at
        self._history: deque[tuple[float, int]] = deque()
        self.last: tuple[int, Progress] | None = None

    def update(self, reports: Mapping[int, Progress | None], now: float) -> None:
        reported = {rank: p for rank, p in reports.items() if p is not None}
        if not reported:
            return
        rank = min(reported, key=lambda r: (reported[r].step, r))
        slowest = reported[rank]
        self.last = (rank, slowest)
        if not self._history or self._history[-1][1] != slowest.step:
            self._history.append((now, slowest.step))
        while len(self._history) > 2 and now - self._history[0][0] > RATE_WINDOW:
            self._history.popleft()

    def rate(self) -> float:
        if len(self._history) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._history[0], self._history[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def line(self, now: float) -> str | None:
        if self.last is None:
            return None
        rank, progress = self.last
        rate = self.rate()
        elapsed = _clock(now - self._started_at)
        desc = f"{progress.desc}: " if progress.desc else ""
        slowest = f"slowest: local rank {rank}"
        if progress.total:
            fraction = min(1.0, max(0.0, progress.step / progress.total))
            filled = int(fraction * BAR_WIDTH)
            bar = "█" * filled + " " * (BAR_WIDTH - filled)
            eta = _clock((progress.total - progress.step) / rate) if rate > 0 else "?"
            return (
                f"{desc}{fraction * 100:3.0f}%|{bar}| {progress.step}/{progress.total} "
                f"[{elapsed}<{eta}, {_rate(rate)}] {slowest}"
            )
        return f"{desc}step {progress.step} [{elapsed}, {_rate(rate)}] {slowest}"
