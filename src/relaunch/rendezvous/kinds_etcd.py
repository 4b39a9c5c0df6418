"""etcd as a store kind of the dynamic rendezvous (see ``kinds``): keys, leases, one watch.

``EtcdKind`` is one node's connections and their ways; ``NodeLease`` and ``LeasePulse`` its
heartbeats; ``create_handler``, ``write_death_notice`` and ``open_reader`` are what
``kind_registry`` asks of the ``etcd``/``etcd-v2`` backends: the handler, a dead agent's death
notice, and the reader of ``relaunch status``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from relaunch.core.durations import seconds
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.rdzv_conf import RendezvousSettings, RendezvousSpec
from relaunch.core.rendezvous.rounds import KeyOf
from relaunch.endpoints import is_loopback
from relaunch.rendezvous.api import RendezvousConnectionError
from relaunch.rendezvous.heartbeat import Silence
from relaunch.rendezvous.kinds import Pulse, SeatShutdown, read_each
from relaunch.rendezvous.roster import Roster
from relaunch.rendezvous.roster_etcd import KeyRoster
from relaunch.rendezvous.rounds import CLOSED, news_prefix
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import StoreError
from relaunch.store.etcd import EtcdStore
from relaunch.store.etcd_feed import PrefixFeed

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler, HandlerOptions
    from relaunch.rendezvous.reader import JobReader

#: What ``relaunch status`` suggests when the cluster cannot be read.
UNREACHABLE_HINT = (
    "check --rdzv-endpoint, and the cluster's credentials: --rdzv-conf user=,password= "
    "or cacert=,cert=,key="
)


def supersede_on_etcd(store: EtcdStore, changed: str, round_signal: str, record: bytes) -> bool:
    """``StoreKind.supersede`` on etcd: the change and its round signal at one revision, one event
    to each member's feed."""
    return store.compare_set(changed, 0, record, also=(round_signal,)).succeeded


class EtcdKind:
    """etcd, for one node of job ``run_id``: joins and tallies as one key per node, heartbeats
    on the node's lease (kept from its first round to its shutdown), a change and its round signal
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

    def supersede(self, changed: str, round_signal: str, record: bytes) -> bool:
        return supersede_on_etcd(self.store, changed, round_signal, record)

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


class NodeLease:
    """This node's etcd lease, kept from its first round to its shutdown: the heartbeat key of
    each round hangs on it. Keeping it across rounds saves a grant and a revoke per node and
    re-form, and a member re-forming never looks lost to a neighbour that has not yet heard."""

    def __init__(self, store: EtcdStore, ttl: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store, self._ttl, self._clock = store, ttl, clock
        self.id: int | None = None
        self._renewed_at = 0.0  # clock.monotonic() of the last grant or renewal

    def renew(self) -> bool:
        """Keep the lease alive; False when there is none, or it expired (its keys are gone)."""
        if self.id is not None and self._store.keep_alive(self.id):
            self._renewed_at = self._clock.monotonic()
            return True
        self.id = None
        return False

    def fresh(self) -> bool:
        """Whether the lease surely lives: renewed within half its time to live."""
        return self.id is not None and self._clock.monotonic() - self._renewed_at < self._ttl / 2

    def grant(self) -> int:
        if self.id is None:
            self.id = self._store.grant_lease(self._ttl)
            self._renewed_at = self._clock.monotonic()
        return self.id

    def revoke(self) -> None:
        """End it now: this node's keys go at once (shutting down)."""
        if self.id is not None:
            lease, self.id = self.id, None
            try:
                self._store.revoke_lease(lease)
            except StoreError:
                pass


class LeasePulse:
    """Heartbeats as the node's etcd lease, which it renews, holding the round's key: when the
    member dies, etcd lets the lease expire and deletes the key, which is how its neighbour
    learns it."""

    def __init__(
        self, store: EtcdStore, settings: plan.Settings, lease: NodeLease, since: float
    ) -> None:
        self._store, self._settings, self._lease = store, settings, lease
        self._held: str | None = None  # the key put on the lease
        self._started = since  # when every member's first beat is due
        self._seen: set[str] = set()
        self._silence = Silence(settings)

    def beat(self, key: str) -> None:
        if self._held == key:
            if self._lease.renew():
                return
        elif not self._lease.fresh():  # a re-form may have outlived it: nobody renews between
            self._lease.renew()
        self._store.set(key, b"", lease=self._lease.grant())
        self._held = key

    def lost(self, key: str, now: float) -> str | None:
        """etcd's verdict (the neighbour's lease expired, its key is gone) stands when this
        judge reached etcd throughout the last ``dead_after``; after an outage the judge saw
        too (a leader election: the neighbour's renewals may have been stuck like its own), the
        neighbour gets ``dead_after`` seconds of reachable time to put its key back."""
        covered = self._silence.tick(now)
        settings = self._settings
        if not self._seen and now - self._started < settings.keep_alive_interval:
            return None  # the first beat: the neighbour may not have beaten yet
        if self._store.get(key).value is not None:
            self._seen.add(key)
            self._silence.heard(key)
            return None
        silence = self._silence.silent(key, covered)
        steady = now - self._silence.stalled_at > settings.dead_after + settings.keep_alive_interval
        if key in self._seen and steady:
            return "its etcd lease expired"
        if silence > settings.dead_after and now - self._started > settings.dead_after:
            return f"no heartbeat for {seconds(settings.dead_after)}"
        return None


def handler_on_etcd(
    run_id: str,
    store: EtcdStore,
    settings: plan.Settings,
    local_addr: str,
    heartbeat_store: EtcdStore,
    watch_store: EtcdStore | None = None,
    clock: Clock = SYSTEM_CLOCK,
    **options: Unpack[HandlerOptions],
) -> DynamicRendezvousHandler:
    """The dynamic handler on etcd (``EtcdKind``)."""
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler

    stores = EtcdKind(run_id, settings, store, heartbeat_store, watch_store, clock)
    return DynamicRendezvousHandler(run_id, stores, settings, local_addr, clock=clock, **options)


def create_handler(params: RendezvousSpec) -> DynamicRendezvousHandler:
    """Build the handler for ``etcd``: the same rendezvous, on an etcd v3 cluster.

    ``--rdzv-endpoint`` lists the members; ``--rdzv-conf`` may set ``protocol``, ``cacert``,
    ``cert``, ``key``, ``user``, ``password`` and ``timeout`` (seconds, per operation).
    """
    from relaunch.rendezvous.death_notice import DeathNotice
    from relaunch.rendezvous.dynamic import node_options

    conf = params.settings
    settings = conf.round_settings(params.min_nodes, params.max_nodes)
    options = conf.etcd_store_arguments()
    store, heartbeat_store, watch_store = (
        EtcdStore(params.endpoint or "127.0.0.1", **options) for _ in range(3)
    )
    try:
        store.get(f"relaunch/{params.run_id}/news/closed")  # reachable, and the credentials work
    except StoreError as exc:
        raise RendezvousConnectionError(f"rendezvous of job {params.run_id!r}: {exc}") from None
    if params.local_addr:
        local_addr = params.local_addr
    elif all(is_loopback(endpoint.host) for endpoint in store.endpoints):
        local_addr = "127.0.0.1"
    else:
        import socket

        local_addr = socket.getfqdn()
    where = {"store": "etcd", "endpoints": params.endpoint or "127.0.0.1", "options": options}
    seat = EtcdSeat(params.endpoint or "127.0.0.1", options, local_addr, settings.dead_after)
    return handler_on_etcd(
        params.run_id,
        store,
        settings,
        local_addr,
        heartbeat_store,
        watch_store=watch_store,
        backend=params.backend,
        on_shutdown=(seat.end, watch_store.close),
        death_notice=DeathNotice(where),
        token=conf.job_token(os.environ),  # for the state copies alone
        where=store.describe(),
        seat=seat,
        **node_options(conf),
    )


class EtcdSeat(SeatShutdown):
    """etcd, for what runs beside the rendezvous (``kinds.StoreSeat``): no node hosts it, so
    what runs beside it runs where a lease of ``lease_ttl`` seconds was taken."""

    hosted = False

    def __init__(
        self, endpoint: str, options: Mapping[str, Any], local_addr: str, lease_ttl: float
    ) -> None:
        super().__init__()
        self._endpoint, self._options = endpoint, options
        self.local_addr, self.lease_ttl = local_addr, lease_ttl

    def connect(self) -> EtcdStore:
        return EtcdStore(self._endpoint, **self._options)

    def host_here(self) -> str | None:
        return None

    def on_move(self, moved: Callable[[], None]) -> None:
        """etcd's members are its own business: the store never moves to another node."""


def write_death_notice(
    where: Mapping[str, Any], changed: str, round_signal: str, record: bytes, timeout: float
) -> bool:
    """A dead agent's death notice (``death_notice``): the change and its round signal, on the
    cluster at ``where``, within ``timeout`` seconds a request."""
    etcd = EtcdStore(where["endpoints"], **{**where["options"], "timeout": timeout})
    try:
        return supersede_on_etcd(etcd, changed, round_signal, record)
    finally:
        etcd.close()


def open_reader(
    endpoint: str,
    run_id: str,
    conf: RendezvousSettings,
    timeout: float,
    environ: Mapping[str, str],
) -> tuple[JobReader, str]:
    """``relaunch status``'s reader of job ``run_id`` on the cluster at ``endpoint``, and the
    cluster in words."""
    from relaunch.rendezvous.reader import EtcdJobReader

    etcd = EtcdStore(endpoint, **{**conf.etcd_store_arguments(), "timeout": timeout})
    return EtcdJobReader(etcd, run_id), etcd.describe()
