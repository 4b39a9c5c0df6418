"""Which node of a round gets which group rank: where the scheduler put it, and where it was.

Nodes join a round in any order (their *tickets*, 1, 2, ... by arrival). Group ranks follow
this rule instead (``place``), so that rank 0 lands where the scheduler says and a restart moves
no rank it does not have to:

1. A node that was a member of an earlier round keeps the group rank it had there, if that rank
   is below the new round's member count. Two nodes claiming one rank: the one from the later
   round keeps it, then the one that arrived first.
2. The places left, lowest first, go to the other nodes in the scheduler's order: by the node
   rank each brings (``--node-rank``, or what the scheduler says: ``SLURM_NODEID``, the MPI
   rank, ``JOB_COMPLETION_INDEX``), then nodes without one in arrival order, and last any node
   whose join record was never read (it died between taking a ticket and registering).

So group rank 0 moves only when its node left, a lost node's place goes to the node that takes
it over, and a first round started in any order gets the scheduler's order. Pure: the lead of a
round calls ``place`` with what the members registered; the final record carries the result
(``Placing``, by ticket) only when it differs from the arrival order.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from relaunch.core.value import Value

#: Bounds of what a node may claim: a hostile record must not allocate or loop without end.
MAX_NODE_RANK = 1 << 31
MAX_ADDR = 255
#: The most members a placing read from the store may place.
MAX_MEMBERS = 1 << 20


class Claim(Value):
    """What a node asks of its place, and where its workers' master would be should it get
    group rank 0. ``last``: ``(round, group rank)`` of the last round it was a member of;
    ``node_rank``: its place in the scheduler's order (``--node-rank``); ``addr``/``port``: a
    free port it found."""

    __slots__ = ("addr", "last", "node_rank", "port")

    last: tuple[int, int] | None
    node_rank: int | None
    addr: str
    port: int

    def __init__(
        self,
        last: tuple[int, int] | None = None,
        node_rank: int | None = None,
        addr: str = "",
        port: int = 0,
    ) -> None:
        self._set(last=last, node_rank=node_rank, addr=addr, port=port)

    @property
    def asks(self) -> bool:
        """Whether the node asks for a place (else any place will do)."""
        return self.last is not None or self.node_rank is not None


class Joiner(Value):
    """One node of a round being completed: its ``ticket`` (arrival, 1-based), its workers, its
    role, and its claim (None: its record was never read)."""

    __slots__ = ("claim", "role", "ticket", "workers")

    ticket: int
    workers: int
    role: str | None
    claim: Claim | None

    def __init__(self, ticket: int, workers: int, role: str | None, claim: Claim | None) -> None:
        self._set(ticket=ticket, workers=workers, role=role, claim=claim)


def place(joiners: Sequence[Joiner]) -> list[Joiner]:
    """``joiners`` in group-rank order, by the rule of this module."""
    count = len(joiners)
    placed: list[Joiner | None] = [None] * count
    kept: set[int] = set()
    keepers = [j for j in joiners if j.claim and j.claim.last and j.claim.last[1] < count]
    for joiner in sorted(keepers, key=_keeper_order):
        assert joiner.claim is not None and joiner.claim.last is not None
        rank = joiner.claim.last[1]
        if placed[rank] is None:
            placed[rank] = joiner
            kept.add(joiner.ticket)
    rest = iter(sorted((j for j in joiners if j.ticket not in kept), key=_newcomer_order))
    return [joiner if joiner is not None else next(rest) for joiner in placed]


def _keeper_order(joiner: Joiner) -> tuple[int, int]:
    assert joiner.claim is not None and joiner.claim.last is not None
    return -joiner.claim.last[0], joiner.ticket


def _newcomer_order(joiner: Joiner) -> tuple[bool, bool, int, int]:
    claim = joiner.claim
    node_rank = None if claim is None else claim.node_rank
    return claim is None, node_rank is None, node_rank or 0, joiner.ticket


class Placing(Value):
    """Where a round's members go, by ticket: the member holding ticket ``t`` has group rank
    ``ranks[t - 1]`` and its first worker global rank ``bases[t - 1]``. Indexed by ticket, so
    that each node finds its own place in O(1) in a record every member reads."""

    __slots__ = ("bases", "ranks")

    ranks: tuple[int, ...]
    bases: tuple[int, ...]

    def __init__(self, ranks: tuple[int, ...], bases: tuple[int, ...]) -> None:
        self._set(ranks=ranks, bases=bases)


def placing_of(placed: Sequence[Joiner]) -> Placing | None:
    """The placing of the members ``placed`` (in group-rank order), or None when that is the
    arrival order (the tickets then give the ranks, and the record says nothing)."""
    if all(joiner.ticket == rank + 1 for rank, joiner in enumerate(placed)):
        return None
    ranks, bases = [0] * len(placed), [0] * len(placed)
    base = 0
    for rank, joiner in enumerate(placed):
        ranks[joiner.ticket - 1], bases[joiner.ticket - 1] = rank, base
        base += joiner.workers
    return Placing(tuple(ranks), tuple(bases))


def assign(placing: Placing | None, ticket: int, through: int, workers: int) -> tuple[int, int]:
    """``(group rank, base global rank)`` of the node holding ``ticket``, with ``workers``
    workers and ``through`` workers up to and including it in arrival order."""
    if placing is None:
        return ticket - 1, through - workers
    if not 1 <= ticket <= len(placing.ranks):
        raise ValueError(f"ticket {ticket} is not in the round's placing")
    return placing.ranks[ticket - 1], placing.bases[ticket - 1]


def encode_placing(placing: Placing) -> dict[str, str]:
    """``placing`` as fields of a round's final record: two arrays of 32-bit numbers, base64
    (a few KiB for thousands of nodes, decoded in microseconds by each of them)."""
    return {"ranks": _pack(placing.ranks), "bases": _pack(placing.bases)}


def decode_placing(fields: Mapping[str, Any], count: int, world_size: int) -> Placing | None:
    """The placing in a final record's ``fields`` (None: the arrival order), checked: each of
    ``count`` members has one group rank, and a first global rank within ``world_size``;
    ValueError saying what is wrong otherwise."""
    if "ranks" not in fields and "bases" not in fields:
        return None
    ranks, bases = _unpack(fields.get("ranks")), _unpack(fields.get("bases"))
    if len(ranks) != count or len(bases) != count:
        raise ValueError(f"the placing does not place {count} members")
    if sorted(ranks) != list(range(count)):
        raise ValueError("the placing does not give each member one group rank")
    if max(bases, default=0) >= world_size:
        raise ValueError("the placing puts a worker beyond the world size")
    return Placing(ranks, bases)


def _pack(values: Sequence[int]) -> str:
    import base64  # only a job of several nodes in a chosen order places its nodes

    return base64.b64encode(struct.pack(f"<{len(values)}I", *values)).decode()


def _unpack(text: object) -> tuple[int, ...]:
    if not isinstance(text, str) or len(text) > 4 * MAX_MEMBERS:
        raise ValueError("not a placing")
    import base64

    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError("not a placing (base64)") from None
    if len(raw) % 4:
        raise ValueError("not a placing (32-bit numbers)")
    return struct.unpack(f"<{len(raw) // 4}I", raw)


def encode_claim(claim: Claim) -> dict[str, Any]:
    """``claim`` as fields of a node's join record (JSON)."""
    fields: dict[str, Any] = {"addr": claim.addr, "port": claim.port}
    if claim.last is not None:
        fields["last"] = list(claim.last)
    if claim.node_rank is not None:
        fields["node_rank"] = claim.node_rank
    return fields


def decode_claim(fields: Mapping[str, Any]) -> Claim:
    """The claim in a node's join record; ValueError saying what is wrong for one no relaunch
    wrote."""
    addr, port = fields.get("addr", ""), fields.get("port", 0)
    if not isinstance(addr, str) or len(addr) > MAX_ADDR:
        raise ValueError("'addr' is not an address")
    if not _whole(port, 65536):
        raise ValueError("'port' is not a port")
    last = fields.get("last")
    if last is not None:
        if not (isinstance(last, list) and len(last) == 2 and all(_whole(n) for n in last)):
            raise ValueError("'last' is not [round, group rank]")
        last = (last[0], last[1])
    node_rank = fields.get("node_rank")
    if node_rank is not None and not _whole(node_rank):
        raise ValueError("'node_rank' is not a whole number")
    return Claim(last, node_rank, addr, port)


def _whole(value: object, below: int = MAX_NODE_RANK) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < below
