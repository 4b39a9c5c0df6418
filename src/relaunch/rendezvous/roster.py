"""Who joined a round, and what many nodes count, kept the way each kind of store does it best.

Both keep every operation of a node O(1), whatever the number of nodes:

- ``CounterRoster`` (the built-in store, and the in-process one): an atomic ``add`` on a counter
  gives each joining node its ticket at once; counts are counters.
- ``roster_etcd.KeyRoster`` (etcd, which has no atomic add): each node writes its own key, in one
  transaction that also claims the round's lead if nobody has; the keys' create revisions order
  the nodes, and counts are counts of keys under a prefix. Writing one's own key is idempotent,
  so a write retried after a member fail-over never counts a node twice.

Counts that many nodes wait on (members done, answers to a presence check) are awaited by one node,
which then writes a single key the others wait for: no store event goes to every node. The
store's kind (``kinds``) says which roster a node uses.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Protocol

from relaunch.core.rendezvous import node_order
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.node_order import Claim, Joiner
from relaunch.core.rendezvous.rounds import Entry, Joined, KeyOf
from relaunch.core.workers.ranks import role_runs
from relaunch.rendezvous.api import BadStoreValue, RendezvousError, store_int
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import Store, StoreTimeout, Versioned

log = logging.getLogger(__name__)


class Roster(Protocol):
    def join(self, round_: int, local_world_size: int, role: str, claim: Claim) -> Joined:
        """Join ``round_`` with ``local_world_size`` workers of ``role``, asking for a place by
        ``claim`` (``core.rendezvous.node_order``), unless it completed already or the job closed.
        """

    def joined(self, round_: int) -> int:
        """How many nodes joined ``round_`` so far."""

    def await_joined(self, round_: int, at_least: int, timeout: float) -> None:
        """Return once ``at_least`` nodes joined ``round_``, or after ``timeout``."""

    def members(self, round_: int, count: int, settings: plan.Settings) -> plan.Members:
        """As the lead: who the first ``count`` joins are."""

    def place(self, entry: Entry, final: plan.Final) -> tuple[int, int] | None:
        """``(ticket, workers through this node)`` in the completed round; None when late."""

    def mark(self, name: str, round_: int) -> None:
        """Count this node once in the tally ``name`` of ``round_``."""

    def tally(self, name: str, round_: int) -> int:
        """How many nodes the tally ``name`` of ``round_`` counts."""

    def await_tally(self, name: str, round_: int, at_least: int, timeout: float) -> int:
        """The tally once it reaches ``at_least``, or as it is after ``timeout``."""


def new_node_id() -> str:
    """A name for this node's keys, unique across the job's nodes and restarts."""
    return f"{os.getpid():x}-{os.urandom(6).hex()}"


class CounterRoster:
    """Joins and tallies as atomic counters (the built-in store). Keys, under ``r{n}/``::

    joins           join counter: ticket, workers so far, role sums (``core.rendezvous.rounds``)
    claims          how many joins ask for a place (``core.rendezvous.node_order``): the lead reads
                    every member's record only when some do, or when their roles differ
    node/{ticket}   that node's record: its join counter value, role and claim (JSON)
    {tally}         a counter

    Waits keep their deadlines on ``clock``.
    """

    def __init__(self, store: Store, key: KeyOf, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store, self._key, self._clock = store, key, clock

    def join(self, round_: int, local_world_size: int, role: str, claim: Claim) -> Joined:
        store, key = self._store, self._key
        if store.get(key("closed", None)).value is not None:
            return Joined(None, closed=True)
        if store.get(key("final", round_)).value is not None:
            round_key = key("round", None)
            return Joined(None, round_now=store_int(round_key, store.get(round_key).value))
        if claim.asks:  # counted before the join: the lead, seeing the join, sees the claim
            store.add(key("claims", round_), 1)
        total = store.add(key("joins", round_), plan.join_increment(local_world_size, role))
        joined = plan.unpack_join(total)
        record = {"total": str(total), "role": role, **node_order.encode_claim(claim)}
        store.set(key(f"node/{joined.ticket}", round_), json.dumps(record).encode())
        return Joined(Entry(joined.ticket, joined.through, 0, joined.ticket == 1))

    def joined(self, round_: int) -> int:
        key = self._key("joins", round_)
        value = self._store.get(key).value
        return plan.unpack_join(store_int(key, value, digits=plan.JOIN_TOTAL_DIGITS)).ticket

    def await_joined(self, round_: int, at_least: int, timeout: float) -> None:
        try:
            self._store.wait([self._key(f"node/{at_least}", round_)], timeout)
        except StoreTimeout:
            pass

    def members(self, round_: int, count: int, settings: plan.Settings) -> plan.Members:
        """A node that took a ticket but died before registering is left out (it is the last
        one here); one in the middle is caught by the heartbeats once the workers start. The
        last member's join total says whether the members have one role; only when they do
        not, or when some ask for a place, are the others' records read."""
        for members in range(count, settings.min_nodes - 1, -1):
            last = self._key(f"node/{members}", round_)
            try:
                self._store.wait([last], settings.keep_alive_interval)
            except StoreTimeout:
                log.warning(
                    "rendezvous: the node holding ticket %d joined but never "
                    "registered; completing the round without it",
                    members,
                )
                continue
            raw = self._store.get(last).value
            total, _, _ = _node_record(last, raw)
            if total.ticket != members:
                raise BadStoreValue(last, raw, "not the join of that ticket")
            claims_key = self._key("claims", round_)
            if total.one_role() and store_int(claims_key, self._store.get(claims_key).value) == 0:
                return plan.Members(members, total.through)
            joiners = self._joiners(round_, members, settings)
            if any(joiner.claim is None for joiner in joiners):
                # A member's record is missing (it died in between): arrival order, and its
                # role counts for none.
                nodes = [(joiner.role, joiner.workers) for joiner in joiners]
                roles = () if total.one_role() else role_runs(nodes)
                return plan.Members(members, total.through, (), roles)
            return placed_members(joiners)
        raise RendezvousError(f"fewer than {settings.min_nodes} joined nodes registered")

    def _joiners(self, round_: int, members: int, settings: plan.Settings) -> list[Joiner]:
        """The first ``members`` nodes, read from their records. A node registers right after
        taking its ticket; one that has not within a keep-alive interval died in between (its
        heartbeat never starts, and the round re-forms): its role and claim are not known."""
        deadline = self._clock.monotonic() + settings.keep_alive_interval
        joiners: list[Joiner] = []
        through_before = 0
        keys = [self._key(f"node/{ticket}", round_) for ticket in range(1, members + 1)]
        reads = get_many(self._store, keys)
        for ticket, (key, read) in enumerate(zip(keys, reads, strict=True), start=1):
            raw = read.value
            if raw is None:
                try:
                    self._store.wait([key], max(0.0, deadline - self._clock.monotonic()))
                    raw = self._store.get(key).value
                except StoreTimeout:
                    pass
            if raw is None:
                joiners.append(Joiner(ticket, 0, None, None))
                continue
            total, role, claim = _node_record(key, raw)
            joiners.append(Joiner(ticket, total.through - through_before, role, claim))
            through_before = total.through
        return joiners

    def place(self, entry: Entry, final: plan.Final) -> tuple[int, int] | None:
        assert entry.ticket is not None
        return (entry.ticket, entry.through) if entry.ticket <= final.count else None

    def mark(self, name: str, round_: int) -> None:
        self._store.add(self._key(name, round_), 1)

    def tally(self, name: str, round_: int) -> int:
        key = self._key(name, round_)
        return store_int(key, self._store.get(key).value)

    def await_tally(self, name: str, round_: int, at_least: int, timeout: float) -> int:
        key = self._key(name, round_)
        deadline = self._clock.monotonic() + timeout
        current = self._store.get(key)
        while store_int(key, current.value) < at_least:
            left = deadline - self._clock.monotonic()
            if left <= 0:
                break
            current = self._store.watch(key, current.version, left)
        return store_int(key, current.value)


def get_many(store: Store, keys: list[str]) -> list[Versioned]:
    """``keys`` read in as few requests as ``store`` can (the built-in store: one per 85)."""
    many = getattr(store, "get_many", None)
    return list(many(keys)) if many is not None else [store.get(key) for key in keys]


def placed_members(joiners: Sequence[Joiner], runs: tuple[plan.Run, ...] = ()) -> plan.Members:
    """As the lead: the members ``joiners`` (in arrival order, ``runs`` placing them on etcd),
    given their group ranks (``core.rendezvous.node_order``)."""
    ordered = node_order.place(joiners)
    one_role = len({joiner.role for joiner in joiners}) <= 1
    roles = () if one_role else role_runs((joiner.role, joiner.workers) for joiner in ordered)
    first = ordered[0].claim
    master = None
    if ordered[0].ticket != 1 and first is not None and first.addr and first.port:
        master = (first.addr, first.port)
    world_size = sum(joiner.workers for joiner in joiners)
    return plan.Members(
        len(joiners), world_size, runs, roles, node_order.placing_of(ordered), master
    )


def node_record(key: str, raw: bytes | None) -> dict[str, object]:
    """A node's join record (JSON object); ``BadStoreValue`` if no relaunch wrote it."""
    try:
        record = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadStoreValue(key, raw, f"not JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("role"), str):
        raise BadStoreValue(key, raw, "not a node's join record")
    return record


def decode_claim(key: str, raw: bytes | None, record: dict[str, object]) -> Claim:
    """The claim in a node's join ``record``; ``BadStoreValue`` if no relaunch wrote it."""
    try:
        return node_order.decode_claim(record)
    except ValueError as exc:
        raise BadStoreValue(key, raw, exc) from None


def _node_record(key: str, raw: bytes | None) -> tuple[plan.JoinTotal, str, Claim]:
    """A ``node/{ticket}`` record's join total, role and claim."""
    record = node_record(key, raw)
    number = record.get("total")
    if not isinstance(number, str):
        raise BadStoreValue(key, raw, "no join total")
    total = store_int(key, number.encode(), digits=plan.JOIN_TOTAL_DIGITS)
    return plan.unpack_join(total), str(record["role"]), decode_claim(key, raw, record)
