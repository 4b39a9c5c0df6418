"""etcd as a store kind of the dynamic rendezvous (see ``kinds``): keys, leases, one watch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from relaunch.core import rendezvous as plan
from relaunch.core.rendezvous import KeyOf
from relaunch.rendezvous.heartbeat import LeasePulse, NodeLease, Pulse
from relaunch.rendezvous.kinds import read_each
from relaunch.rendezvous.roster import Roster
from relaunch.rendezvous.roster_etcd import KeyRoster
from relaunch.rendezvous.rounds import CLOSED, news_prefix
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.etcd import EtcdStore
from relaunch.store.etcd_feed import PrefixFeed


def supersede_on_etcd(store: EtcdStore, changed: str, bell: str, record: bytes) -> bool:
    """``StoreKind.supersede`` on etcd: the change and its bell at one revision, one event to
    each member's feed."""
    return store.compare_set(changed, 0, record, also=(bell,)).succeeded


class EtcdKind:
    """etcd, for one node of job ``run_id``: joins and tallies as one key per node, heartbeats
    on the node's lease (kept from its first round to its shutdown), a change and its bell
    written at one revision, a round's notes in one range read, and the job's news through one
    watch (on ``watch_store``, else on ``heartbeat_store``)."""

    def __init__(
        self,
        run_id: str,
        settings: plan.Settings,
        store: EtcdStore,
        heartbeat_store: EtcdStore,
        watch_store: EtcdStore | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store, self.heartbeat_store, self.watch_store = store, heartbeat_store, watch_store
        self._lease = NodeLease(heartbeat_store, settings.dead_after, clock)
        # A beat is due each keep-alive interval, and the lease lasts only dead_after: a
        # renewal that sits on one member longer than an interval (a member waiting out a
        # leader election, or cut off from the others) would let the lease expire while
        # another member could take it, and this node would look lost to its neighbour,
        # which reached etcd all along. Each attempt is left after an interval for the next
        # member; the beat as a whole still has the store's timeout.
        heartbeat_store.attempt_timeout = settings.keep_alive_interval
        self.feed = PrefixFeed(
            watch_store or heartbeat_store,
            news_prefix(run_id),
            settings.dead_after,  # a stream silent that long is checked: one read
            clock,
        )

    @property
    def news(self) -> PrefixFeed:
        return self.feed

    def roster(self, key: KeyOf, node_id: str) -> Roster:
        return KeyRoster(self.store, key, node_id)

    def answers(self, key: KeyOf, node_id: str) -> Roster:
        return KeyRoster(self.watch_store or self.heartbeat_store, key, node_id)

    def supersede(self, changed: str, bell: str, record: bytes) -> bool:
        return supersede_on_etcd(self.store, changed, bell, record)

    def read_notes(self, prefix: str, names: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        """One range read for several notes."""
        if len(names) <= 1:
            yield from read_each(self.store, prefix, names)
            return
        found, _ = self.store.read_prefix(prefix)
        wanted = set(names)
        for key, versioned in found.items():
            name = key[len(prefix) :]
            if name in wanted and versioned.value is not None:
                yield name, versioned.value

    def pulse(self, settings: plan.Settings, since: float) -> Pulse:
        return LeasePulse(self.heartbeat_store, settings, self._lease, since)

    @staticmethod
    def lost_node_grace(settings: plan.Settings) -> float:
        """The neighbour's silence counts from its last beat seen, checked once a beat; an etcd
        lease lasts whole seconds, and etcd looks for expired leases every half second or so."""
        return math.ceil(settings.dead_after) + 1.0 + settings.keep_alive_interval

    def close_job(
        self,
        key: KeyOf,
        next_round: int,
        join_timeout: float,
        mark_finished: Callable[[], None],
        record: bytes,
    ) -> None:
        """Delete the job's keys, then write ``closed`` on a lease of ``join_timeout``: the
        members in the exit barrier wait for it, and nodes waiting to join the next round are
        dismissed. Nothing needs marking finished: the keys are gone."""
        self.store.delete_prefix(key("", None))
        lease = self.store.grant_lease(join_timeout)
        self.store.set(key("final", next_round), CLOSED, lease=lease)
        self.store.set(key("closed", None), record, lease=lease)

    def release(self) -> None:
        """This node's heartbeat keys go at once."""
        self._lease.revoke()
