"""Evicting a straggling node to a waiting spare (``--evict-stragglers SECONDS``), as decisions:
pure functions of what the judge (the agent of group rank 0) has seen, and ``now``.

A node flagged as a straggler in every judgement for ``window`` seconds is evicted when a spare
waits to take its place: it leaves the job, excluded for the cooldown a failing node gets
(``core.run.exclusion``), and the group re-forms with the spare. The window asks for more than
one judgement (the first flag starts it, a later one ends it), and the caller's window should
exceed the seconds a measurement is made over (``stragglers.WINDOW``, ``SECTION_WINDOW``), so
that one pause (a collection, a checkpoint) does not evict a node. Without a spare the node is
only flagged, and that is said once. Never below the minimum of ``--nnodes``, never two nodes at
once (one eviction a round), and not the node evicted last unless a later measurement flagged
it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from relaunch.core.value import Value
from relaunch.core.workers.stragglers import ranks_text


class SlowNode(Protocol):
    """A node flagged as a straggler (``core.workers.stragglers.SlowNode``, from
    ``flagged_nodes``): its name, group rank, the global ranks found slow, and why."""

    @property
    def node(self) -> str: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    def reason(self) -> str: ...


class Watch(Value):
    """What the judge remembers: when each node's current run of flags began (node -> time),
    the nodes told to have no spare in that run, the node evicted last and when, and whether
    this round already evicted one."""

    __slots__ = ("evicted", "evicted_at", "evicting", "since", "told")

    since: Mapping[str, float]
    told: frozenset[str]
    evicted: str | None
    evicted_at: float
    evicting: bool

    def __init__(
        self,
        since: Mapping[str, float] | None = None,
        told: frozenset[str] = frozenset(),
        evicted: str | None = None,
        evicted_at: float = 0.0,
        evicting: bool = False,
    ) -> None:
        self._set(since=dict(since or {}), told=told, evicted=evicted, evicted_at=evicted_at)
        self._set(evicting=evicting)

    def new_round(self) -> Watch:
        """A new round formed: its measurements start afresh, and it may evict one node."""
        return Watch(None, frozenset(), self.evicted, self.evicted_at, False)


class Evict(Value):
    """Evict ``node`` (group rank ``node_rank``): ``line`` says so on every node."""

    __slots__ = ("line", "node", "node_rank")

    node: str
    node_rank: int
    line: str

    def __init__(self, node: str, node_rank: int, line: str) -> None:
        self._set(node=node, node_rank=node_rank, line=line)


class NoSpare(Value):
    """A node straggled for the window, and no spare waits: it stays; ``line`` says so once."""

    __slots__ = ("line", "node")

    node: str
    line: str

    def __init__(self, node: str, line: str) -> None:
        self._set(node=node, line=line)


def decide(
    watch: Watch,
    flagged: Sequence[SlowNode],
    now: float,
    window: float,
    members: int,
    min_nodes: int,
    spares: int,
) -> tuple[Watch, Evict | NoSpare | None]:
    """The watch after one judgement at ``now`` that flagged ``flagged``, and what follows:
    evict one node, say that none can be, or nothing. ``members``: the nodes of the round,
    ``spares``: the nodes waiting to join it."""
    names = {slow.node for slow in flagged}
    since = {slow.node: watch.since.get(slow.node, now) for slow in flagged}
    told = watch.told & names
    watch = Watch(since, told, watch.evicted, watch.evicted_at, watch.evicting)
    if watch.evicting:
        return watch, None
    due = [
        slow
        for slow in flagged
        if now - since[slow.node] >= window
        # the node evicted last comes back only on a measurement made after its eviction
        and not (slow.node == watch.evicted and since[slow.node] <= watch.evicted_at)
    ]
    if not due:
        return watch, None
    slow = min(due, key=lambda s: (since[s.node], s.node_rank))
    where = f"node {slow.node} (node {slow.node_rank}, {ranks_text(slow.ranks)})"
    lasted = f"for {now - since[slow.node]:.0f} s"
    if spares < 1 or members - 1 + spares < min_nodes:
        if slow.node in watch.told:
            return watch, None
        line = (
            f"{where} has been a straggler ({slow.reason()}) {lasted}; no spare is waiting "
            "to take its place, so it stays (--evict-stragglers needs a spare node: one more "
            "agent than the maximum of --nnodes)"
        )
        return Watch(since, told | {slow.node}, watch.evicted, watch.evicted_at), NoSpare(
            slow.node, line
        )
    line = f"{where} evicted as a straggler ({slow.reason()}) {lasted}; a spare takes its place"
    return Watch({}, frozenset(), slow.node, now, True), Evict(slow.node, slow.node_rank, line)
