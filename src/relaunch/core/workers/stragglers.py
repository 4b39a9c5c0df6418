"""Stragglers: the nodes whose ranks spend well more time in their sections than the rest of the
job's, and the ranks whose steps per second fall well below the job's median.

Two measurements, for two kinds of work. In synchronous training (a collective every step:
DDP, FSDP) every rank steps at the slowest one's pace, so their rates are all equal; what
differs is the time each spends outside the collective, computing: a slow node's ranks spend
longer inside their ``relaunch.section(...)`` blocks, the fast ones wait in the collective,
outside them. So each agent samples, every ``INTERVAL`` seconds, its ranks' ``report_progress``
steps (``RankRates``: steps per second) and the seconds each spent in each section name
(``SectionTimes``: seconds a step, over ``SECTION_WINDOW``), and publishes them; the node of
group rank 0 judges the job (``flagged_nodes``):

- a rank is slow in a section when its seconds a step in it pass ``factor`` times the median of
  the ranks of the other nodes (and by ``MIN_EXCESS`` seconds at least): the baseline leaves out
  the node judged, so that in a job of two nodes the slow one is measured against the fast;
- a rank is slow by its rate when its steps per second fall below the job's median divided by
  the factor (``flag``): in asynchronous work a slow rank steps less often (its sections, where
  it has any, flag it too).

A node with a rank slow either way is flagged once, with the ranks found slow, and the section
its ranks are furthest behind in (or, found by its rate alone, its slowest rank's rate). Pure:
callers pass the reports and ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from relaunch.core.value import Value

#: Seconds between two samples of the ranks' steps, and between two publications.
INTERVAL = 3.0
#: The posts per second every node of a job makes together, at most: in a large job each node
#: posts less often (``interval``), so that the store's load stays bounded whatever the size.
MAX_POSTS_PER_SECOND = 100.0


def interval(nodes: int, base: float = INTERVAL) -> float:
    """Seconds between two posts of each node of a job of ``nodes`` nodes."""
    return max(base, nodes / MAX_POSTS_PER_SECOND)


#: Seconds of samples a rate, or a section's seconds a step, is computed over.
WINDOW = 12.0
#: Seconds of samples a section's seconds a step is computed over: shorter than a rate's, as
#: the time of the steps before a slowdown hides it (a healthy step is short, so the steps
#: before it outnumber the slow ones): two intervals' samples find a node 5x slower about 3 s
#: after it slowed, where 12 s of them take about 5 s.
SECTION_WINDOW = 6.0
#: Seconds a step a rank must spend in a section beyond the other nodes' median to be slow in
#: it, besides the factor: a section of a few milliseconds is not worth a flag for its jitter.
MIN_EXCESS = 0.005


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


class SectionTimes:
    """Seconds a step each rank spends in each section name, from samples ``(time of the
    sample, step, {name: (seconds spent in it, runs ended)})``: the seconds spent over the
    window divided by the steps reported over it (by the runs ended, for a rank that reports no
    steps)."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[float, int | None, dict[str, tuple[float, int]]]]] = {}

    def add(
        self, rank: int, taken_at: float, step: int | None, times: Mapping[str, tuple[float, int]]
    ) -> None:
        if not times:
            return
        samples = self._samples.setdefault(rank, deque())
        if samples and samples[-1][0] >= taken_at:
            return
        samples.append((taken_at, step, dict(times)))
        while len(samples) > 2 and taken_at - samples[0][0] > SECTION_WINDOW:
            samples.popleft()

    def per_step(self) -> dict[int, dict[str, float]]:
        """Each rank's seconds a step in each section name that ran over the window."""
        found = {}
        # A copy of the items: the agent's metrics may read while its reporter adds samples.
        for rank, samples in list(self._samples.items()):
            if len(samples) < 2:
                continue
            (_, first, before), (_, last, after) = samples[0], samples[-1]
            steps = last - first if first is not None and last is not None else 0
            mine = {}
            for name, (spent, runs) in after.items():
                if name not in before:
                    continue
                ran, took = runs - before[name][1], spent - before[name][0]
                if ran > 0 and took >= 0:
                    mine[name] = took / (steps if steps > 0 else ran)
            if mine:
                found[rank] = mine
        return found


class Measured(Value):
    """One rank's latest measurements, as the job's posts carry them: its node (``node``, the
    node's name in the rendezvous, and ``node_rank``, its group rank), its steps per second
    (None: unknown) and its seconds a step in each section name (``SectionTimes``)."""

    __slots__ = ("node", "node_rank", "rank", "rate", "sections")

    node: str
    node_rank: int
    rank: int
    rate: float | None
    sections: Mapping[str, float]

    def __init__(
        self,
        node: str,
        node_rank: int,
        rank: int,
        rate: float | None = None,
        sections: Mapping[str, float] | None = None,
    ) -> None:
        self._set(node=node, node_rank=node_rank, rank=rank, rate=rate)
        self._set(sections={} if sections is None else sections)


class SlowNode(Value):
    """A node flagged a straggler: ``node`` (its name in the rendezvous, as its agent knows it),
    ``node_rank`` (its group rank), ``ranks`` (its global ranks found slow, in order), and why:
    ``section`` the section its ranks are furthest behind in, ``value`` their seconds a step in
    it and ``median`` the other nodes' ranks' median; or, found by its rate alone (``section``
    ""), ``value`` its slowest rank's steps per second and ``median`` the job's median rate.
    ``factor`` is the ``--straggler-factor`` it was judged with."""

    __slots__ = ("factor", "median", "node", "node_rank", "ranks", "section", "value")

    node: str
    node_rank: int
    ranks: tuple[int, ...]
    section: str
    value: float
    median: float
    factor: float

    def __init__(
        self,
        node: str,
        node_rank: int,
        ranks: Sequence[int],
        section: str,
        value: float,
        median: float,
        factor: float,
    ) -> None:
        self._set(node=node, node_rank=node_rank, ranks=tuple(ranks), section=section)
        self._set(value=value, median=median, factor=factor)

    def describe(self) -> str:
        """One line: the node, its ranks found slow, and the measurement that found them."""
        where = f"node {self.node} (node {self.node_rank}, {ranks_text(self.ranks)})"
        return f"{where} is a straggler: {self.reason()}"

    def reason(self) -> str:
        """The measurement that found it: ``'compute' takes 0.52 s a step, ...``."""
        if self.section:
            return (
                f"{self.section!r} takes {_seconds(self.value)} s a step, the other nodes' "
                f"median is {_seconds(self.median)} s"
            )
        return (
            f"{self.value:.3g} steps/s, the job's median is {self.median:.3g} (flagged below "
            f"1/{self.factor:g} of it)"
        )


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 4-7`` (a run), ``ranks 1, 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(rank) for rank in ranks)


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value >= 0.095 else f"{value:.2g}"


def flagged_nodes(measured: Sequence[Measured], factor: float) -> list[SlowNode]:
    """The nodes flagged as stragglers from the job's latest measurements (one ``Measured`` a
    rank), by node rank: see the module docstring.

    The contract ``--evict-stragglers`` relies on: each ``SlowNode`` names one node (``node``,
    its rendezvous name, and ``node_rank``) with the ranks of it found slow, in order; a node
    appears at most once; a job whose ranks all keep the same pace gives none; nothing but
    ``measured`` and ``factor`` decides (the same measurements, the same nodes)."""
    names = {m.node_rank: m.node for m in measured}
    slow_ranks: dict[int, set[int]] = {}
    found: dict[int, tuple[float, str, float, float]] = {}  # node rank -> (ratio, name, s, median)
    for name in sorted({name for m in measured for name in m.sections}):
        having = [m for m in measured if name in m.sections]
        ordered = sorted(m.sections[name] for m in having)
        by_node: dict[int, list[Measured]] = {}
        for m in having:
            by_node.setdefault(m.node_rank, []).append(m)
        for node_rank, mine in by_node.items():
            median = _median_without(ordered, [m.sections[name] for m in mine])
            if median is None:
                continue
            for m in mine:
                spent = m.sections[name]
                if spent > median * factor and spent - median >= MIN_EXCESS:
                    slow_ranks.setdefault(node_rank, set()).add(m.rank)
                    ratio = spent / median if median > 0 else float("inf")
                    if node_rank not in found or ratio > found[node_rank][0]:
                        found[node_rank] = (ratio, name, spent, median)
    rates = {m.rank: m.rate for m in measured if m.rate is not None}
    where = {m.rank: m.node_rank for m in measured}
    by_rate: dict[int, Straggler] = {}
    for straggler in flag(rates, factor)[1]:  # slowest first
        node_rank = where[straggler.rank]
        slow_ranks.setdefault(node_rank, set()).add(straggler.rank)
        by_rate.setdefault(node_rank, straggler)
    flagged = []
    for node_rank in sorted(slow_ranks):
        ranks = sorted(slow_ranks[node_rank])
        if node_rank in found:
            _, name, spent, median = found[node_rank]
            flagged.append(
                SlowNode(names[node_rank], node_rank, ranks, name, spent, median, factor)
            )
        else:
            rate = by_rate[node_rank]
            flagged.append(
                SlowNode(names[node_rank], node_rank, ranks, "", rate.rate, rate.median, factor)
            )
    return flagged


def _median_without(ordered: Sequence[float], removed: Sequence[float]) -> float | None:
    """The median of ``ordered`` (sorted) less one occurrence of each value of ``removed`` (all
    in it); None when nothing is left. O(k log n) for k removed: group rank 0 judges each node
    of a large job against all the others at every post."""
    from bisect import bisect_left

    left = len(ordered) - len(removed)
    if left <= 0:
        return None
    gone: list[int] = []  # the indices taken out, in order
    for value in sorted(removed):
        at = bisect_left(ordered, value)
        if gone and gone[-1] >= at:
            at = gone[-1] + 1  # an equal value taken out already
        gone.append(at)

    def kept(k: int) -> float:
        """The ``k``-th value left."""
        index = k
        for at in gone:
            if at > index:
                break
            index += 1
        return ordered[index]

    return (kept((left - 1) // 2) + kept(left // 2)) / 2
