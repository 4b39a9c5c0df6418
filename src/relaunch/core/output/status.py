"""What each agent tells the rest of the job about itself, and the view of the whole job.

Every few seconds each agent posts a ``NodeStatus`` (its ranks' states, steps, rates and last
signs of life, its restarts) as a note of the running round; the agent of group rank 0 reads
every node's, judges stragglers and the job's pace (``job_view``), and posts the ``JobView``.
``relaunch status`` reads both, and ``core.output.status_table`` shows them. Pure: records in,
records and text out; times are ``time.time()``, passed in.

The notes come from the store, that is from outside: ``decode`` checks every field's type and
raises ``ValueError`` saying which is wrong, so that nothing of the wrong shape gets further; and
whatever text is shown passes through ``printable`` on its way to a terminal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relaunch.core.defaults import MAX_SECONDS
from relaunch.core.value import Value
from relaunch.core.workers import stragglers
from relaunch.core.workers.stragglers import SlowNode

if TYPE_CHECKING:
    from relaunch.core.workers.eviction import Evict

#: What a checked field may be: an integer (never a bool), a number, a string.
_KINDS: dict[str, tuple[type, ...]] = {"integer": (int,), "number": (int, float), "string": (str,)}


def _field(data: dict[str, Any], name: str, kind: str, optional: bool = False) -> Any:
    """``data[name]``, checked to be of ``kind`` (or None when ``optional``)."""
    if name not in data:
        if optional:
            return None
        raise ValueError(f"no field {name!r}")
    value: Any = data[name]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, _KINDS[kind]):
        raise ValueError(f"field {name!r}: expected {kind}, got {_shown(value)}")
    if kind != "number" or not isinstance(value, (int, float)):
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"field {name!r}: {_shown(value)} is out of range") from None


def _object(raw: object, what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: expected a JSON object, got {_shown(raw)}")
    return raw


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"field {what!r}: expected a list, got {_shown(value)}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _load(raw: bytes) -> Any:
    """JSON from outside: ``ValueError`` for anything that is not (nesting too deep included)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def printable(text: str, newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on (escape sequences, carriage
    returns, bells, bidirectional overrides: what ``str.isprintable`` refuses) written as a
    Python escape; newlines kept when ``newlines``. What came from outside goes through it
    before it is printed."""
    if text.isprintable():
        return text
    if newlines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class RankStatus(Value):
    """One worker as its agent last saw it."""

    __slots__ = ("last_sign", "local_rank", "rank", "rate", "sections", "state", "step", "total")

    rank: int
    local_rank: int
    state: str  # "running", or how it ended: "exited 0", "exited 3", "killed by SIGKILL"
    step: int | None
    total: int | None
    rate: float | None  # steps per second over ``stragglers.WINDOW``
    last_sign: float | None  # its last report, heartbeat or section (None: never)
    #: Seconds a step in each section name over ``stragglers.SECTION_WINDOW`` (``SectionTimes``).
    sections: dict[str, float]

    def __init__(
        self,
        rank: int,
        local_rank: int,
        state: str,
        step: int | None = None,
        total: int | None = None,
        rate: float | None = None,
        last_sign: float | None = None,
        sections: dict[str, float] | None = None,
    ) -> None:
        self._set(rank=rank, local_rank=local_rank, state=state, step=step, total=total)
        self._set(rate=rate, last_sign=last_sign, sections=sections or {})


class NodeStatus(Value):
    """One agent's post: who it is, how its workers stand, the restarts it knows of."""

    __slots__ = (
        "group_rank",
        "lost_seconds",
        "node",
        "posted_at",
        "ranks",
        "restart_reasons",
        "restarts",
        "stale_after",
        "state",
    )

    node: str
    group_rank: int
    state: str  # the group's WorkerState
    restarts: int
    posted_at: float
    ranks: list[RankStatus]
    restart_reasons: list[str]
    #: Seconds this node lost to restarts (the goodput ledger's total, ``core.run.goodput``).
    lost_seconds: float
    #: Seconds after ``posted_at`` that a post with no newer one is stale: the job's keep-alive
    #: detection time, or two posts' interval if longer (None: not said,
    #: ``status_table.STALE_AFTER``).
    stale_after: float | None

    def __init__(
        self,
        node: str,
        group_rank: int,
        state: str,
        restarts: int,
        posted_at: float,
        ranks: list[RankStatus] | None = None,
        restart_reasons: list[str] | None = None,
        lost_seconds: float = 0.0,
        stale_after: float | None = None,
    ) -> None:
        self._set(node=node, group_rank=group_rank, state=state, restarts=restarts)
        self._set(posted_at=posted_at, ranks=[] if ranks is None else ranks)
        self._set(restart_reasons=[] if restart_reasons is None else restart_reasons)
        self._set(lost_seconds=lost_seconds, stale_after=stale_after)

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> NodeStatus:
        """The note ``encode`` wrote; ``ValueError`` saying what is wrong if it is not one."""
        data = _object(_load(raw), "a node's status")
        ranks = []
        for item in _list(data.get("ranks", []), "ranks"):
            rank = _object(item, "a rank's status")
            ranks.append(
                RankStatus(
                    _field(rank, "rank", "integer"),
                    _field(rank, "local_rank", "integer"),
                    _field(rank, "state", "string"),
                    _field(rank, "step", "integer", optional=True),
                    _field(rank, "total", "integer", optional=True),
                    _field(rank, "rate", "number", optional=True),
                    _field(rank, "last_sign", "number", optional=True),
                    _sections(rank.get("sections", {})),
                )
            )
        reasons = _list(data.get("restart_reasons", []), "restart_reasons")
        if not all(isinstance(reason, str) for reason in reasons):
            raise ValueError("field 'restart_reasons': expected strings")
        return cls(
            _field(data, "node", "string"),
            _field(data, "group_rank", "integer"),
            _field(data, "state", "string"),
            _field(data, "restarts", "integer"),
            _time(_field(data, "posted_at", "number"), "posted_at"),
            ranks,
            reasons,
            _field(data, "lost_seconds", "number", optional=True) or 0.0,
            _stale_after(_field(data, "stale_after", "number", optional=True)),
        )


#: At most this many section names a rank, each at most ``MAX_NAME`` characters, in a post.
MAX_SECTIONS = 8
MAX_NAME = 128
#: The longest eviction line a view may carry (``core.workers.eviction.Evict.line``).
MAX_EVICT_LINE = 1024


def _sections(raw: object) -> dict[str, float]:
    """A rank's seconds a step by section name, checked: a few names, each a finite number of
    seconds, not negative."""
    named = _object(raw, "a rank's sections")
    if len(named) > MAX_SECTIONS:
        raise ValueError(f"sections: more than {MAX_SECTIONS} names")
    sections = {}
    for name, spent in named.items():
        if len(name) > MAX_NAME:
            raise ValueError(f"sections: a name longer than {MAX_NAME} characters")
        number = isinstance(spent, (int, float)) and not isinstance(spent, bool)
        if not number or not 0 <= spent <= MAX_SECONDS:  # also refuses nan
            raise ValueError(f"sections: {_shown(spent)} is not seconds")
        sections[name] = float(spent)
    return sections


def _time(value: float, name: str) -> float:
    """A post's clock reading: a finite number (NaN would make every age comparison false: a
    post that never ages)."""
    if not math.isfinite(value):
        raise ValueError(f"field {name!r}: {value!r} is not a time")
    return value


def _stale_after(value: float | None) -> float | None:
    """A post's ``stale_after``: seconds > 0 and at most ``MAX_SECONDS`` (None: not said), so
    that no post claims to stay fresh for ever."""
    if value is not None and not 0 < value <= MAX_SECONDS:
        raise ValueError(f"field 'stale_after': {value!r} is not seconds in (0, {MAX_SECONDS:.0f}]")
    return value


class Standing(Value):
    """What the round whose posts are shown says of them: ``over`` (it re-forms, or a newer
    round formed: its posts are the past), ``lost`` (the group rank its change removed: a node
    lost, gone or excluded; None: none), ``formed_at`` (when it formed, ``time.time()``; None:
    not known) and ``every`` (seconds between a node's posts)."""

    __slots__ = ("every", "formed_at", "lost", "over")

    over: bool
    lost: int | None
    formed_at: float | None
    every: float

    def __init__(
        self,
        over: bool = False,
        lost: int | None = None,
        formed_at: float | None = None,
        every: float = stragglers.INTERVAL,
    ) -> None:
        self._set(over=over, lost=lost, formed_at=formed_at, every=every)


class Slowest(Value):
    """The rank furthest behind: the one the job waits for."""

    __slots__ = ("node", "rank", "step", "total")

    rank: int
    node: str
    step: int
    total: int | None

    def __init__(self, rank: int, node: str, step: int, total: int | None) -> None:
        self._set(rank=rank, node=node, step=step, total=total)


class JobView(Value):
    """Group rank 0's verdict on the job: its median rate, the ranks below it (global rank ->
    rate), the slowest rank, the job's pace (the slowest rank's rate), the seconds left (None:
    unknown), the nodes flagged stragglers (``stragglers.flagged_nodes``: by their sections'
    time or their rates) and the node it evicts as a straggler (``core.workers.eviction``;
    None: none)."""

    __slots__ = (
        "eta",
        "evict",
        "median",
        "posted_at",
        "rate",
        "slow_nodes",
        "slowest",
        "stragglers",
    )

    median: float | None
    stragglers: dict[int, float]
    slowest: Slowest | None
    rate: float | None
    eta: float | None
    posted_at: float
    slow_nodes: list[SlowNode]
    evict: Evict | None

    def __init__(
        self,
        median: float | None,
        stragglers: dict[int, float],
        slowest: Slowest | None,
        rate: float | None,
        eta: float | None,
        posted_at: float,
        slow_nodes: list[SlowNode] | None = None,
        evict: Evict | None = None,
    ) -> None:
        self._set(median=median, stragglers=stragglers, slowest=slowest, rate=rate, eta=eta)
        self._set(posted_at=posted_at, slow_nodes=slow_nodes or [], evict=evict)

    def slow_ranks(self) -> set[int]:
        """Every rank flagged: below the median rate, or on a node flagged."""
        return set(self.stragglers).union(*(node.ranks for node in self.slow_nodes))

    def as_dict(self) -> dict[str, Any]:
        fields = super().as_dict()
        if fields["evict"] is None:
            del fields["evict"]  # the view of a job that evicts nobody, as it always was
        return fields

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> JobView:
        """The view ``encode`` wrote; ``ValueError`` saying what is wrong if it is not one."""
        data = _object(_load(raw), "the job's view")
        slow: dict[int, float] = {}
        for rank, rate in _object(data.get("stragglers", {}), "stragglers").items():
            if not (rank.isascii() and rank.isdigit() and len(rank) < 20):
                raise ValueError(f"stragglers: expected a rank, got {_shown(rank)}")
            slow[int(rank)] = _field({"rate": rate}, "rate", "number")
        slowest = None
        if data.get("slowest") is not None:
            item = _object(data["slowest"], "the slowest rank")
            slowest = Slowest(
                _field(item, "rank", "integer"),
                _field(item, "node", "string"),
                _field(item, "step", "integer"),
                _field(item, "total", "integer", optional=True),
            )
        evict = None
        if data.get("evict") is not None:
            from relaunch.core.workers.eviction import Evict  # only where a node is evicted

            item = _object(data["evict"], "the node evicted")
            evict = Evict(
                _field(item, "node", "string"),
                _field(item, "node_rank", "integer"),
                _field(item, "line", "string"),
            )
            # The line becomes every node's restart reason: one printable line, of a node rank
            if evict.node_rank < 0 or len(evict.line) > MAX_EVICT_LINE:
                raise ValueError("the node evicted: not a node rank, or a line too long")
            if not (evict.line.isprintable() and evict.node.isprintable()):
                raise ValueError("the node evicted: not printable")
        return cls(
            _field(data, "median", "number", optional=True),
            slow,
            slowest,
            _field(data, "rate", "number", optional=True),
            _field(data, "eta", "number", optional=True),
            _field(data, "posted_at", "number"),
            [_slow_node(item) for item in _list(data.get("slow_nodes", []), "slow_nodes")],
            evict,
        )


def _slow_node(raw: object) -> SlowNode:
    item = _object(raw, "a node flagged")
    ranks = _list(item.get("ranks"), "ranks")
    if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise ValueError("field 'ranks': expected a list of ranks")
    return SlowNode(
        _field(item, "node", "string"),
        _field(item, "node_rank", "integer"),
        ranks,
        _field(item, "section", "string"),
        _field(item, "value", "number"),
        _field(item, "median", "number"),
        _field(item, "factor", "number"),
    )


def job_view(nodes: Sequence[NodeStatus], factor: float, now: float) -> JobView:
    """The view of the job from every node's post: the ranks below median / ``factor``, and the
    nodes flagged (``stragglers.flagged_nodes``)."""
    rates = {r.rank: r.rate for node in nodes for r in node.ranks if r.rate is not None}
    median, slow = stragglers.flag(rates, factor)
    measured = [
        stragglers.Measured(node.node, node.group_rank, r.rank, r.rate, r.sections)
        for node in nodes
        for r in node.ranks
    ]
    reported = [(r, node.node) for node in nodes for r in node.ranks if r.step is not None]
    slowest = None
    rate = eta = None
    if reported:
        rank, where = min(reported, key=lambda pair: (pair[0].step or 0, pair[0].rank))
        assert rank.step is not None
        slowest = Slowest(rank.rank, where, rank.step, rank.total)
        rate = rank.rate
        if rank.total is not None and rate:
            eta = max(0.0, (rank.total - rank.step) / rate)
    slow_nodes = stragglers.flagged_nodes(measured, factor)
    return JobView(median, {s.rank: s.rate for s in slow}, slowest, rate, eta, now, slow_nodes)


def job_bar(view: JobView, elapsed: float | None = None) -> str | None:
    """The job-wide bar (group rank 0's console): the slowest rank's step over the total, the
    job's rate and ETA, and where the slowest rank is; None before any rank reported.
    ``elapsed``: the seconds the run has taken, shown when given."""
    slowest = view.slowest
    if slowest is None:
        return None
    pace = _rate(view.rate)
    where = f"slowest: rank {slowest.rank} on {slowest.node}"
    if slowest.total:
        fraction = min(1.0, max(0.0, slowest.step / slowest.total))
        eta = "?" if view.eta is None else _clock(view.eta)
        took = "" if elapsed is None else f"{_clock(elapsed)}<"
        return (
            f"job {fraction * 100:3.0f}% {slowest.step}/{slowest.total} "
            f"[{took}{eta}, {pace}] {where}"
        )
    took = "" if elapsed is None else f"{_clock(elapsed)}, "
    return f"job step {slowest.step} [{took}{pace}] {where}"


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _rate(rate: float | None) -> str:
    if not rate:
        return "? step/s"
    return f"{rate:.3g} step/s" if rate >= 1 else f"{1 / rate:.3g} s/step"
