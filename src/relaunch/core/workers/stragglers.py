"""Stragglers: ranks whose steps per second fall well below the job's median.

Every agent samples its ranks' ``report_progress`` steps every ``INTERVAL`` seconds
(``RankRates``), publishes their rates, and the node of group rank 0 compares every rank of
the job with the median (``flag``): a rank slower than the median divided by the factor is a
straggler. Pure: callers pass the reports and ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from relaunch.core.value import Value

#: Seconds between two samples of the ranks' steps, and between two publications.
INTERVAL = 3.0
#: The posts per second every node of a job makes together, at most: in a large job each node
#: posts less often (``interval``), so that the store's load stays bounded whatever the size.
MAX_POSTS_PER_SECOND = 100.0


def interval(nodes: int, base: float = INTERVAL) -> float:
    """Seconds between two posts of each node of a job of ``nodes`` nodes."""
    return max(base, nodes / MAX_POSTS_PER_SECOND)


#: Seconds of samples a rate is computed over.
WINDOW = 12.0


class RankRates:
    """Steps per second of each rank, from samples ``(time of the report, step)``."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[float, int]]] = {}

    def add(self, rank: int, reported_at: float, step: int) -> None:
        samples = self._samples.setdefault(rank, deque())
        if samples and samples[-1][0] >= reported_at:
            return  # no report since the last sample
        samples.append((reported_at, step))
        while len(samples) > 2 and reported_at - samples[0][0] > WINDOW:
            samples.popleft()

    def rates(self, now: float) -> dict[int, float]:
        """Each rank's steps per second over the window; a rank silent since its last sample
        counts its silence (its rate falls as time passes without a report)."""
        rates = {}
        # A copy of the items: the agent's metrics read rates while its reporter adds samples.
        for rank, samples in list(self._samples.items()):
            if len(samples) < 2:
                continue
            (t0, s0), (_, s1) = samples[0], samples[-1]
            if now > t0:
                rates[rank] = max(0.0, (s1 - s0) / (now - t0))
        return rates


class Straggler(Value):
    """A rank below the job's median rate by more than the factor."""

    __slots__ = ("median", "rank", "rate")

    rank: int
    rate: float
    median: float

    def __init__(self, rank: int, rate: float, median: float) -> None:
        self._set(rank=rank, rate=rate, median=median)

    def describe(self, factor: float) -> str:
        return (
            f"rank {self.rank} is a straggler: {self.rate:.3g} steps/s, the job's median is "
            f"{self.median:.3g} (flagged below 1/{factor:g} of it)"
        )


def flag(rates: Mapping[int, float], factor: float) -> tuple[float | None, list[Straggler]]:
    """The median rate of ``rates`` (None with fewer than two ranks) and the ranks below
    ``median / factor``, slowest first."""
    if len(rates) < 2:
        return None, []
    import statistics  # 3 ms of imports (fractions, decimal) a one-node launch never needs

    median = statistics.median(rates.values())
    slow = [Straggler(rank, rate, median) for rank, rate in rates.items() if rate < median / factor]
    return median, sorted(slow, key=lambda s: (s.rate, s.rank))
