"""Joins and tallies on etcd, which has no atomic add: one key per node (see ``roster``)."""

from __future__ import annotations

import json

from relaunch.core.rendezvous import node_order
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.node_order import Claim, Joiner
from relaunch.core.rendezvous.rounds import Entry, Joined, KeyOf
from relaunch.rendezvous.api import BadStoreValue, store_int
from relaunch.rendezvous.roster import decode_claim, node_record, placed_members
from relaunch.store import etcd
from relaunch.store.etcd import EtcdStore


class KeyRoster:
    """Joins and tallies as one key per node (etcd). Keys, under ``r{n}/``::

    join/{node}     this node's join: its number of workers, its role and its claim
                    (``core.rendezvous.node_order``; JSON); the create revision orders it
    lead            the node that completes the round (the first to join)
    {tally}/{node}  this node, counted
    """

    def __init__(self, store: EtcdStore, key: KeyOf, node_id: str) -> None:
        self._store, self._key, self._node = store, key, node_id

    def join(self, round_: int, local_world_size: int, role: str, claim: Claim) -> Joined:
        """One transaction: unless the job closed or the round completed, write this node's
        key and claim the lead if nobody has; else read why not. Nothing else is read: the
        transaction's revision is the key's, unless an earlier attempt wrote it (a write
        retried after an ambiguous failure), whose place and lead it keeps."""
        key, node = self._key, self._node.encode()
        closed, final, lead = key("closed", None), key("final", round_), key("lead", round_)
        mine = key(f"join/{self._node}", round_)
        reply = self._store.txn(
            [etcd.absent(closed), etcd.absent(final)],
            [
                etcd.put(mine, _join_record(local_world_size, role, claim), previous=True),
                etcd.txn_op([etcd.absent(lead)], [etcd.put(lead, node)]),
            ],
            [etcd.read(closed), etcd.read(key("round", None))],
        )
        if not reply.succeeded:
            now_closed, round_now = reply.reads
            round_key = key("round", None)
            now = store_int(round_key, round_now.value) if round_now else 0
            return Joined(None, now_closed is not None, now)
        earlier, claimed = reply.reads[0], reply.nested[0]
        revision = reply.revision if earlier is None else earlier.create_revision
        if claimed or (earlier is not None and self._store.get(lead).value == node):
            return Joined(Entry(1, local_world_size, revision, True))
        return Joined(Entry(None, 0, revision, False))

    def joined(self, round_: int) -> int:
        return self._store.count_prefix(self._key("join/", round_))[0]

    def await_joined(self, round_: int, at_least: int, timeout: float) -> None:
        self._store.await_prefix_count(self._key("join/", round_), at_least, timeout)

    def members(self, round_: int, count: int, settings: plan.Settings) -> plan.Members:
        joins = self._store.range_prefix(self._key("join/", round_), count)
        joiners = [
            Joiner(ticket, *_join_value(name, value))
            for ticket, (name, value, _) in enumerate(joins, start=1)
        ]
        revisions = [revision for _, _, revision in joins]
        runs = plan.revision_runs(
            [(revision, j.workers) for revision, j in zip(revisions, joiners, strict=True)]
        )
        return placed_members(joiners, runs)

    def place(self, entry: Entry, final: plan.Final) -> tuple[int, int] | None:
        return plan.place_by_revision(final.runs, entry.revision)

    def mark(self, name: str, round_: int) -> None:
        self._store.set(self._key(f"{name}/{self._node}", round_), b"")

    def tally(self, name: str, round_: int) -> int:
        return self._store.count_prefix(self._key(f"{name}/", round_))[0]

    def await_tally(self, name: str, round_: int, at_least: int, timeout: float) -> int:
        return self._store.await_prefix_count(self._key(f"{name}/", round_), at_least, timeout)


def _join_record(workers: int, role: str, claim: Claim) -> bytes:
    return json.dumps({"workers": workers, "role": role, **node_order.encode_claim(claim)}).encode()


def _join_value(key: str, raw: bytes) -> tuple[int, str, Claim]:
    """A ``join/{node}`` record's number of workers, role and claim; ``BadStoreValue`` if no
    relaunch wrote it."""
    record = node_record(key, raw)
    workers = record.get("workers")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BadStoreValue(key, raw, "no number of workers")
    return workers, str(record["role"]), decode_claim(key, raw, record)
