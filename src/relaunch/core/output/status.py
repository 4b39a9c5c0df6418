"""What each agent tells the rest of the job about itself, and the view of the whole job.

Every few seconds each agent posts a ``NodeStatus`` (its ranks' states, steps, rates and last
signs of life, its restarts) as a note of the running round; the agent of group rank 0 reads
every node's, judges stragglers and the job's pace (``job_view``), and posts the ``JobView``.
``relaunch status`` reads both, and ``format_table`` prints them. Pure: records in, records and
text out; times are ``time.time()``, passed in.

The notes come from the store, that is from outside: ``decode`` checks every field's type and
raises ``ValueError`` saying which is wrong, so that nothing of the wrong shape gets further; and
whatever text is shown passes through ``printable`` on its way to a terminal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from relaunch.core.durations import seconds
from relaunch.core.workers import stragglers

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


@dataclass(frozen=True)
class RankStatus:
    """One worker as its agent last saw it."""

    rank: int
    local_rank: int
    state: str  # "running", or how it ended: "exited 0", "exited 3", "killed by SIGKILL"
    step: int | None = None
    total: int | None = None
    rate: float | None = None  # steps per second over ``stragglers.WINDOW``
    last_sign: float | None = None  # its last report, heartbeat or section (None: never)


@dataclass(frozen=True)
class NodeStatus:
    """One agent's post: who it is, how its workers stand, the restarts it knows of."""

    node: str
    group_rank: int
    state: str  # the group's WorkerState
    restarts: int
    posted_at: float
    ranks: list[RankStatus] = field(default_factory=list)
    restart_reasons: list[str] = field(default_factory=list)
    #: Seconds this node lost to restarts (the goodput ledger's total, ``core.run.goodput``).
    lost_seconds: float = 0.0
    #: Seconds after ``posted_at`` that a post with no newer one is stale: the job's keep-alive
    #: detection time, or two posts' interval if longer (None: not said, ``STALE_AFTER``).
    stale_after: float | None = None

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

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
            _field(data, "posted_at", "number"),
            ranks,
            reasons,
            _field(data, "lost_seconds", "number", optional=True) or 0.0,
            _field(data, "stale_after", "number", optional=True),
        )


#: Seconds after which a post that does not say when it goes stale is: the keep-alive detection
#: time of the default rendezvous settings (5 s beats, 3 missed, checked once a beat).
STALE_AFTER = 20.0


@dataclass(frozen=True)
class Standing:
    """What the round whose posts are shown says of them: ``over`` (it re-forms, or a newer
    round formed: its posts are the past), ``lost`` (the group rank its change removed: a node
    lost, gone or excluded; None: none), ``formed_at`` (when it formed, ``time.time()``; None:
    not known) and ``every`` (seconds between a node's posts)."""

    over: bool = False
    lost: int | None = None
    formed_at: float | None = None
    every: float = stragglers.INTERVAL


def health(node: NodeStatus, standing: Standing, now: float) -> str:
    """How ``node`` stands, as ``relaunch status`` says it: ``lost`` (its round's change removed
    it), ``past`` (its round is over), ``stale`` (no post within its ``stale_after``) or
    ``posted`` (its post is fresh: its own state stands)."""
    if standing.lost == node.group_rank:
        return "lost"
    if standing.over:
        return "past"
    limit = STALE_AFTER if node.stale_after is None else node.stale_after
    return "stale" if now - node.posted_at > limit else "posted"


def node_words(node: NodeStatus, standing: Standing, now: float) -> str:
    """The node's cell: its name, and its state unless that is not known to hold any more."""
    verdict = health(node, standing, now)
    ago = f"posted {_ago(node.posted_at, now)}"
    if verdict == "lost":
        return f"{node.node} (LOST, last {ago})"
    if verdict == "past":
        return f"{node.node} (was {node.state}, {ago})"
    if verdict == "stale":
        return f"{node.node} (STALE: no post for {seconds(now - node.posted_at)}, was {node.state})"
    return f"{node.node} ({node.state}, {ago})"


def missing_words(group_rank: int, standing: Standing, now: float) -> str:
    """The cell of a member that posted nothing: what is coming in the first interval after
    its round formed, and that nothing came after it."""
    if standing.lost == group_rank:
        return "(LOST before its first post)"
    if standing.over or standing.formed_at is None:
        return "(no status posted yet)"
    elapsed = max(0.0, now - standing.formed_at)
    if elapsed <= standing.every:
        return f"(starting: its first post is due within {seconds(standing.every)})"
    return f"(STALE: no post {seconds(elapsed)} after the round formed)"


@dataclass(frozen=True)
class Slowest:
    """The rank furthest behind: the one the job waits for."""

    rank: int
    node: str
    step: int
    total: int | None


@dataclass(frozen=True)
class JobView:
    """Group rank 0's verdict on the job: its median rate, the stragglers (global rank -> rate),
    the slowest rank, the job's pace (the slowest rank's rate) and the seconds left (None:
    unknown)."""

    median: float | None
    stragglers: dict[int, float]
    slowest: Slowest | None
    rate: float | None
    eta: float | None
    posted_at: float

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

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
        return cls(
            _field(data, "median", "number", optional=True),
            slow,
            slowest,
            _field(data, "rate", "number", optional=True),
            _field(data, "eta", "number", optional=True),
            _field(data, "posted_at", "number"),
        )


def job_view(nodes: Sequence[NodeStatus], factor: float, now: float) -> JobView:
    """The view of the job from every node's post: stragglers below median / ``factor``."""
    rates = {r.rank: r.rate for node in nodes for r in node.ranks if r.rate is not None}
    median, slow = stragglers.flag(rates, factor)
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
    return JobView(median, {s.rank: s.rate for s in slow}, slowest, rate, eta, now)


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


def _ago(then: float | None, now: float) -> str:
    return "-" if then is None else f"{max(0.0, now - then):.1f}s ago"


def format_table(
    run_id: str,
    nodes: Sequence[NodeStatus],
    view: JobView | None,
    restarts: int,
    now: float,
    note: str = "",
    members: int | None = None,
    standing: Standing | None = None,
) -> str:
    """The job as ``relaunch status`` prints it: one line per rank, under its node, which says
    its group's state and when it last posted (every few seconds: its heartbeat here).
    ``members``: how many nodes the round has; those that posted nothing get a line saying so.
    ``standing``: what the round says of its posts: a node lost, or silent past its detection
    time, or of a round that is over, is never shown in its posted state."""
    standing = standing or Standing()
    lost = max((node.lost_seconds for node in nodes), default=0.0)
    lines = [
        f"job {run_id}: {len(nodes)} node(s), {sum(len(n.ranks) for n in nodes)} rank(s), "
        f"{restarts} restart(s) used"
        + (f", {lost:.1f}s lost to them" if lost else "")
        + (f"; {note}" if note else "")
    ]
    bar = None if view is None else job_bar(view)
    if bar is not None:
        lines.append(f"  {bar}")
    header = ("node", "group", "rank", "local", "state", "step", "rate", "last sign", "flag")
    rows: list[tuple[str, ...]] = []
    slow = {} if view is None else view.stragglers
    for node in sorted(nodes, key=lambda n: n.group_rank):
        beat = node_words(node, standing, now)
        verdict = health(node, standing, now)
        for r in sorted(node.ranks, key=lambda r: r.rank):
            step = "-" if r.step is None else (f"{r.step}/{r.total}" if r.total else str(r.step))
            rate = "-" if r.rate is None else f"{r.rate:.3g}/s"
            flag = "straggler" if r.rank in slow else ""
            rows.append(
                (
                    beat,
                    str(node.group_rank),
                    str(r.rank),
                    str(r.local_rank),
                    _RANK_STATE.get(verdict, r.state),
                    step,
                    rate,
                    _ago(r.last_sign, now),
                    flag,
                )
            )
            beat = ""
    for missing in missing_nodes(nodes, members):
        words = missing_words(missing, standing, now)
        rows.append((words, str(missing), "", "", "", "", "", "", ""))
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    for row in (header, *rows):
        lines.append(
            "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        )
    for number, reason in enumerate(restart_reasons(nodes), 1):
        lines.append(f"  restart {number}: {reason}")
    return "\n".join(lines)


#: A rank's state in the table where its node's post no longer holds.
_RANK_STATE = {"lost": "lost", "stale": "unknown"}


def restart_reasons(nodes: Sequence[NodeStatus]) -> list[str]:
    """Why the group restarted, restart by restart, as the nodes tell it: the node whose
    workers failed says what failed, the others the same prefixed with its name, which is kept.
    A restart told differently by different nodes lists each telling, joined by " | "."""
    told: list[str] = []
    for index in range(max((len(node.restart_reasons) for node in nodes), default=0)):
        seen = dict.fromkeys(
            node.restart_reasons[index] for node in nodes if index < len(node.restart_reasons)
        )
        named = [r for r in seen if not any(o != r and o.endswith(f": {r}") for o in seen)]
        told.append(" | ".join(named))
    return told


def missing_nodes(nodes: Sequence[NodeStatus], members: int | None) -> list[int]:
    """The group ranks below ``members`` that posted no status."""
    posted = {node.group_rank for node in nodes}
    return [rank for rank in range(members or 0) if rank not in posted]


def as_json(
    run_id: str,
    nodes: Sequence[NodeStatus],
    view: JobView | None,
    restarts: int,
    members: int | None = None,
    standing: Standing | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The same, for scripts (``relaunch status --json``); each node's ``health`` as of ``now``
    (``health``; None: as of its own post)."""
    standing = standing or Standing()
    return {
        "run_id": run_id,
        "restarts": restarts,
        "restart_reasons": restart_reasons(nodes),
        "nodes": [
            {
                **asdict(node),
                "health": health(node, standing, node.posted_at if now is None else now),
            }
            for node in sorted(nodes, key=lambda n: n.group_rank)
        ],
        "missing": missing_nodes(nodes, members),
        "job": None if view is None else asdict(view),
    }
