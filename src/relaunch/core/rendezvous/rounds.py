"""The dynamic rendezvous, as decisions: pure functions of what a node read and ``now``.

How a round works (the I/O side lives in ``relaunch.rendezvous.dynamic``):

- A node joins round ``r`` with O(1) store operations whatever the number of nodes; nobody
  retries a compare-and-set. On the built-in store it is one atomic ``add`` on the round's join
  counter, which packs several sums, so the reply gives the node its *ticket* (1, 2, ... in
  arrival order, its group rank plus one), the sum of the workers of every node up to it (its
  base global rank), and whether those nodes all have one role (``JoinTotal.one_role``). etcd
  has no atomic add: there each node writes its own key (its workers and role) in one
  transaction that also claims the round's lead if nobody has, and the order is the keys' create
  revisions, which the final record carries as ``runs`` (``revision_runs``,
  ``place_by_revision``).
- The first node (ticket 1, or the lead) completes the round: at ``max_nodes`` joins, or at
  ``min_nodes`` once ``last_call_timeout`` has passed since the count reached ``min_nodes``. It
  writes the round's final record (compare-and-set from absent, so there is only ever one),
  carrying the member count, the world size, and its own address and port for
  MASTER_ADDR/MASTER_PORT; when the members' roles differ, their roles too (``roles``), from
  which each node counts its role ranks (``core.workers.ranks.place_in_runs``).
- Group ranks follow the tickets unless a node asks for a place: the rank it had in an earlier
  round, or its place in the scheduler's order. The lead then reads the members' join records
  and places them (``core.rendezvous.node_order``); the final record carries the ``placing``, and
  the address and port of the member it put at group rank 0 for MASTER_ADDR/MASTER_PORT.
- A node whose ticket is beyond the final count arrived late: it joins the next round and waits
  there; running nodes see it (``nodes_waiting``) and restart into that larger round. When the
  round is full (``max_nodes``) it waits there as a spare, for as long as the round runs: when
  a member is lost, the next round completes with the spare in its place.
- Each member heartbeats its own counter and watches the next group rank on a ring: a dead node is
  noticed after ``keep_alive_interval * keep_alive_max_attempt`` at O(1) cost per node.
- A change while the round runs (``core.rendezvous.membership``) marks it for re-forming, with the
size the
  next round expects.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

from relaunch.core.durations import seconds, span
from relaunch.core.rendezvous.node_order import Placing
from relaunch.core.value import Value
from relaunch.core.workers.ranks import RoleRun

#: The join counter packs four sums (``join_increment``), lowest digits first: tickets (one a
#: node), workers, role fingerprints, and their squares. Tickets and each node's workers stay
#: below ``TICKET_SPAN``; the other spans hold their sums for that many nodes.
TICKET_SPAN = 1 << 24
WORKER_SPAN = 1 << 48
FINGERPRINT_SPAN = 1 << 88
#: The store holds the join counter as a decimal number of about 90 digits.
JOIN_TOTAL_DIGITS = 100
#: FNV-1a, 64 bits (``role_fingerprint``).
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
FNV_MASK = (1 << 64) - 1


def role_fingerprint(role: str) -> int:
    """A 64-bit number for ``role`` (FNV-1a): equal roles give equal numbers, and two roles of
    one job the same one with a chance of about 2**-64. Pure Python: a launch imports no hash
    library for it."""
    mark = FNV_OFFSET
    for byte in role.encode():
        mark = ((mark ^ byte) * FNV_PRIME) & FNV_MASK
    return mark


def join_increment(local_world_size: int, role: str) -> int:
    """What a node of ``local_world_size`` workers of ``role`` adds to a round's join counter.

    The sums of the role fingerprints and of their squares tell, in the one counter every node
    adds to anyway, whether all the nodes up to a ticket have one role (``JoinTotal.one_role``):
    the common case then needs no read of each node's role."""
    if not 1 <= local_world_size < TICKET_SPAN:
        raise ValueError(f"a node runs 1 to {TICKET_SPAN - 1} workers, not {local_world_size}")
    mark = role_fingerprint(role)
    return 1 + TICKET_SPAN * (local_world_size + WORKER_SPAN * (mark + FINGERPRINT_SPAN * mark**2))


class JoinTotal(NamedTuple):
    """The join counter's value as a node's ``add`` returned it: its ``ticket`` (nodes up to and
    including it), the workers of those nodes (``through``), and the sums of their role
    fingerprints and of the fingerprints' squares."""

    ticket: int
    through: int
    marks: int
    squares: int

    def one_role(self) -> bool:
        """Whether the nodes up to this ticket all have one role. Their fingerprints are all
        equal exactly when n * sum(x**2) == sum(x)**2 (Cauchy-Schwarz)."""
        return self.ticket * self.squares == self.marks**2


def unpack_join(total: int) -> JoinTotal:
    """The four sums of the join counter's value ``total``."""
    rest, ticket = divmod(total, TICKET_SPAN)
    rest, through = divmod(rest, WORKER_SPAN)
    squares, marks = divmod(rest, FINGERPRINT_SPAN)
    return JoinTotal(ticket, through, marks, squares)


class Settings(Value):
    __slots__ = (
        "join_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "last_call_timeout",
        "max_nodes",
        "min_nodes",
    )

    min_nodes: int
    max_nodes: int
    join_timeout: float
    last_call_timeout: float
    keep_alive_interval: float
    keep_alive_max_attempt: int

    def __init__(
        self,
        min_nodes: int,
        max_nodes: int,
        join_timeout: float = 600.0,
        last_call_timeout: float = 30.0,
        keep_alive_interval: float = 5.0,
        keep_alive_max_attempt: int = 3,
    ) -> None:
        self._set(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=join_timeout,
            last_call_timeout=last_call_timeout,
            keep_alive_interval=keep_alive_interval,
            keep_alive_max_attempt=keep_alive_max_attempt,
        )
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"nodes must satisfy 1 <= min <= max, got {self.min_nodes}:{self.max_nodes}"
            )
        for name in ("join_timeout", "last_call_timeout", "keep_alive_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.keep_alive_max_attempt < 1:
            raise ValueError(
                f"keep_alive_max_attempt must be >= 1, got {self.keep_alive_max_attempt}"
            )

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a node counts as dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


#: One run of members whose join keys have consecutive create revisions and the same number of
#: workers: ``(first revision, nodes, workers per node)``.
Run = tuple[int, int, int]


class Final(Value):
    """A completed round: who is in it and where the workers' master is. ``runs`` places the
    members by the create revisions of their join keys (etcd); empty, the tickets do.
    ``version``: the store's version of the record (what the round's later keys come after).
    ``roles``: the members' roles, when they differ."""

    __slots__ = (
        "count",
        "master_addr",
        "master_port",
        "placing",
        "roles",
        "runs",
        "version",
        "world_size",
    )

    count: int
    world_size: int
    master_addr: str
    master_port: int
    runs: tuple[Run, ...]
    version: int
    #: The members' roles and workers in group-rank order (``core.workers.ranks.role_runs``); empty
    #: when they all have one role.
    roles: tuple[RoleRun, ...]
    #: Where the members go (``core.rendezvous.node_order.Placing``); None: by their tickets.
    placing: Placing | None

    def __init__(
        self,
        count: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        runs: tuple[Run, ...] = (),
        version: int = 0,
        roles: tuple[RoleRun, ...] = (),
        placing: Placing | None = None,
    ) -> None:
        self._set(
            count=count,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            runs=runs,
            version=version,
            roles=roles,
            placing=placing,
        )


def revision_runs(joins: list[tuple[int, int]]) -> tuple[Run, ...]:
    """The members ``(create revision, workers)`` in revision order, as runs: one run when the
    nodes joined back to back with the same number of workers, whatever their number."""
    runs: list[Run] = []
    for revision, workers in joins:
        if runs:
            first, nodes, per_node = runs[-1]
            if revision == first + nodes and workers == per_node:
                runs[-1] = (first, nodes + 1, per_node)
                continue
        runs.append((revision, 1, workers))
    return tuple(runs)


def place_by_revision(runs: tuple[Run, ...], revision: int) -> tuple[int, int] | None:
    """``(ticket, workers up to and including this node)`` of the member whose join key has
    create revision ``revision``; None when the round completed without it."""
    ticket = through = 0
    for first, nodes, per_node in runs:
        if first <= revision < first + nodes:
            before = revision - first
            return ticket + before + 1, through + (before + 1) * per_node
        ticket += nodes
        through += nodes * per_node
    return None


class Step(str, enum.Enum):
    WAIT = "WAIT"  # nothing to do until the deadline or a change
    COMPLETE = "COMPLETE"  # (ticket 1) write the final record with ``count`` members
    MEMBER = "MEMBER"  # the round is complete and this node is in it
    LATE = "LATE"  # the round completed without this node: join the next one
    FAIL = "FAIL"  # join_timeout passed


class JoinDecision(Value):
    """What a joining node does next (``decide_join``), with what that step needs."""

    __slots__ = ("count", "deadline", "reason", "step")

    step: Step
    deadline: float | None  # WAIT: when to decide again at the latest
    count: int  # COMPLETE: how many members
    reason: str  # FAIL: what was waited for

    def __init__(
        self, step: Step, deadline: float | None = None, count: int = 0, reason: str = ""
    ) -> None:
        self._set(step=step, deadline=deadline, count=count, reason=reason)


def completion_target(settings: Settings, expected: int | None) -> int:
    """How many joins complete a round at once (the rest wait for the last call)."""
    wanted = settings.max_nodes if expected is None else min(expected, settings.max_nodes)
    return max(wanted, settings.min_nodes)


def decide_join(
    settings: Settings,
    ticket: int | None,
    joined: int,
    final: Final | None,
    started_at: float,
    min_reached_at: float | None,
    now: float,
    previous_running: bool = False,
    expected: int | None = None,
    member: bool = False,
) -> JoinDecision:
    """What a node holding ``ticket`` does next, having seen ``joined`` joins and ``final``.

    ``ticket`` is None when the node's place is known only from the final record (etcd, where
    only the lead knows it is first); ``member`` then says whether the final record places it.
    ``min_reached_at`` is when this node first saw ``joined >= min_nodes`` (None before).
    ``previous_running``: the round before still runs (its members have not come over yet), so
    this round must not complete; its nodes are spares, which wait past ``join_timeout`` for as
    long as it runs. ``expected``: how many nodes the round that was superseded
    expects (its survivors plus the waiting ones); reaching it completes the round at once.
    """
    if final is not None:
        inside = member if ticket is None else ticket <= final.count
        return JoinDecision(Step.MEMBER if inside else Step.LATE)
    if ticket is not None and ticket > settings.max_nodes:
        return JoinDecision(Step.LATE)
    fail_at = started_at + settings.join_timeout
    if now >= fail_at:
        if previous_running:  # a spare: it waits as long as the full job it stands by runs
            return JoinDecision(Step.WAIT, deadline=now + settings.join_timeout)
        if ticket != 1:
            waited = f"the first node to complete the round ({joined} joined)"
        else:
            waited = f"{settings.min_nodes} node(s) to join ({joined} joined)"
        return JoinDecision(
            Step.FAIL, reason=f"waited {seconds(settings.join_timeout)} for {waited}"
        )
    if ticket != 1 or previous_running:
        return JoinDecision(Step.WAIT, deadline=fail_at)
    if joined >= completion_target(settings, expected):
        return JoinDecision(Step.COMPLETE, count=min(joined, settings.max_nodes))
    if min_reached_at is not None:
        complete_at = min_reached_at + settings.last_call_timeout
        if now >= complete_at:
            return JoinDecision(Step.COMPLETE, count=min(joined, settings.max_nodes))
        return JoinDecision(Step.WAIT, deadline=min(complete_at, fail_at))
    return JoinDecision(Step.WAIT, deadline=fail_at)


#: Seconds a node waits for other nodes before it says what it waits for (the environment's
#: ``RELAUNCH_WAIT_NOTICE`` sets it), and how many times that it waits between two such lines.
NOTICE_AFTER = 20.0
NOTICE_REPEAT = 3


class Waiting(Value):
    """What a node waiting in a round saw, for the line that says so (``wait_line``): ``joined``
    nodes in the round; ``last_call_at``, when the round completes with them (the lead, once
    ``min_nodes`` joined; None otherwise); ``running``, the members of the round this node
    stands by as a spare (None: not a spare)."""

    __slots__ = ("joined", "last_call_at", "running")

    joined: int
    last_call_at: float | None
    running: int | None

    def __init__(
        self, joined: int, last_call_at: float | None = None, running: int | None = None
    ) -> None:
        self._set(joined=joined, last_call_at=last_call_at, running=running)


def joined_words(joined: int, low: int, high: int) -> str:
    """``joined`` nodes of a round that wants ``low`` to ``high``, in words: ``1 of 2 joined``,
    ``3 of 2 to 4 joined``."""
    return f"{joined} of {low} joined" if low == high else f"{joined} of {low} to {high} joined"


def encode_size(settings: Settings) -> bytes:
    """The round's ``size`` record (its lead writes it: ``relaunch status`` reads how many
    nodes the round wants): ``min:max``."""
    return f"{settings.min_nodes}:{settings.max_nodes}".encode()


def decode_size(raw: bytes) -> tuple[int, int]:
    """The ``(min, max)`` of a ``size`` record; ``ValueError`` for one no relaunch wrote."""
    low, sep, high = raw.decode("ascii", "replace").partition(":")
    if not (sep and low.isdigit() and high.isdigit() and len(low) < 10 and len(high) < 10):
        raise ValueError(f"{raw[:20]!r} is not a 'min:max' size")
    if not 1 <= int(low) <= int(high):
        raise ValueError(f"{raw[:20]!r} is not a size of 1 <= min <= max")
    return int(low), int(high)


def wait_line(
    settings: Settings, waiting: Waiting, job: str, where: str, now: float, give_up_at: float
) -> str:
    """What a node waiting for others says: what it waits for, how many of how many, where (job
    ``job``, its store at ``where``: empty, not said) and until when (``give_up_at``, on the
    clock of ``now``)."""
    place = f"job {job!r}" + (f" at {where}" if where else "")
    low, high = settings.min_nodes, settings.max_nodes
    joined = waiting.joined
    if waiting.running is not None:
        return (
            f"waiting as a spare for a place in {place} ({waiting.running} of at most {high} "
            "nodes running): it takes the place of a node that is lost, for as long as the "
            "job runs"
        )
    counted = f"({joined_words(joined, low, high)}, {place})"
    giving_up = f"giving up in {span(max(0.0, give_up_at - now))}"
    if joined < low:
        more = low - joined
        return f"waiting for {more} more node{'' if more == 1 else 's'} {counted}; {giving_up}"
    if waiting.last_call_at is not None:
        return (
            f"waiting up to {span(max(0.0, waiting.last_call_at - now))} for more nodes "
            f"{counted}; then starting with {joined}"
        )
    return f"waiting for the round to complete {counted}; {giving_up}"


def notice_after(value: str | None) -> tuple[float, str | None]:
    """The seconds before a waiting node first says so, from the environment's
    ``RELAUNCH_WAIT_NOTICE`` (None: not set), and what is wrong with a value that is not a
    number of seconds above 0 (the default is used then)."""
    if value is None or not value.strip():
        return NOTICE_AFTER, None
    try:
        after = float(value)
    except ValueError:
        after = 0.0
    if not 0 < after < float("inf"):
        return NOTICE_AFTER, (
            f"RELAUNCH_WAIT_NOTICE={value!r:.40} is not a number of seconds above 0; "
            f"using {seconds(NOTICE_AFTER)}"
        )
    return after, None


def ring_neighbour(group_rank: int, count: int) -> int | None:
    """The group rank whose heartbeat this node watches (None when alone)."""
    if count < 2:
        return None
    return (group_rank + 1) % count


def is_dead(last_change_at: float, now: float, settings: Settings) -> bool:
    """Whether a heartbeat that last changed at ``last_change_at`` has stopped."""
    return now - last_change_at > settings.dead_after


#: ``key(name, round)``: a store key of the job (``round`` None) or of one of its rounds.
KeyOf = Callable[[str, "int | None"], str]


class Entry(Value):
    """A node's join of a round. ``ticket`` (its place, 1-based) and ``through`` (workers up to
    and including it) when the store tells them at once, else None and 0 until the final record
    places the node by ``revision``, the create revision of its join key. ``lead``: this node
    completes the round."""

    __slots__ = ("lead", "revision", "through", "ticket")

    ticket: int | None
    through: int
    revision: int
    lead: bool

    def __init__(self, ticket: int | None, through: int, revision: int, lead: bool) -> None:
        self._set(ticket=ticket, through=through, revision=revision, lead=lead)


class Members(NamedTuple):
    """Who the lead found in a round it completes: ``nodes`` members, ``world_size`` workers,
    the ``runs`` that place them by revision (etcd; else empty), their ``roles`` in
    group-rank order (empty when they all have one), their ``placing`` (``Final.placing``)
    and, when group rank 0 is not the lead, where that member's workers' master is."""

    nodes: int
    world_size: int
    runs: tuple[Run, ...] = ()
    roles: tuple[RoleRun, ...] = ()
    placing: Placing | None = None
    master: tuple[str, int] | None = None


class Joined(Value):
    """What trying to join a round found: the ``entry`` when this node joined it; otherwise
    whether the job is ``closed``, and the round the job's ``round`` record names now."""

    __slots__ = ("closed", "entry", "round_now")

    entry: Entry | None
    closed: bool
    round_now: int

    def __init__(self, entry: Entry | None, closed: bool = False, round_now: int = 0) -> None:
        self._set(entry=entry, closed=closed, round_now=round_now)
