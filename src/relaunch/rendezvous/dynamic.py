"""The dynamic rendezvous handler: elastic membership on a shared store.

It joins rounds (``rounds``), watches the running one (``heartbeat``), and re-forms it when its
membership changes (``core.rendezvous.membership``); ``backends`` builds it from the ``--rdzv-*``
flags, over one ``kinds.StoreKind``: the node's connections, and what their kind of store does its
own way. The handler has torch's methods only; what the job's nodes share beside joining (the
restart budget, the presence check, notes, the change and its listener) is its ``job``
(``dynamic_job.DynamicJob``). Both share where the node stands (``node_membership.NodeMembership``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from relaunch.core.rendezvous import node_order
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import (
    ChangeKind,
    MembershipChange,
    encode_change,
    expected_size,
)
from relaunch.core.run import exclusion
from relaunch.core.workers.ranks import role_place
from relaunch.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from relaunch.rendezvous.death_notice import DeathNotice
from relaunch.rendezvous.dynamic_job import DynamicJob
from relaunch.rendezvous.heartbeat import RoundWatch
from relaunch.rendezvous.kinds import StoreKind
from relaunch.rendezvous.kinds_counter import CounterKind
from relaunch.rendezvous.node_membership import NodeMembership
from relaunch.rendezvous.roster import new_node_id
from relaunch.rendezvous.rounds import Rounds, closed_record
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread
from relaunch.store.api import Store, StoreError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from relaunch.core.rendezvous.rdzv_conf import RendezvousSettings
    from relaunch.rendezvous.failover import StoreFailover
    from relaunch.rendezvous.kinds import StoreSeat

log = logging.getLogger(__name__)


class HandlerOptions(TypedDict, total=False):
    """The handler's options beside its stores (see ``DynamicRendezvousHandler``)."""

    backend: str
    on_shutdown: tuple[Callable[[], object], ...]
    identity: str
    exclusion_policy: exclusion.ExclusionPolicy | None
    store_host_probe: Callable[[float], None] | None
    node_rank: int | None
    death_notice: DeathNotice | None
    failover: StoreFailover | None
    token: str | None
    where: str
    seat: StoreSeat | None


class NodeOptions(TypedDict):
    """The options of ``node_options``."""

    identity: str
    exclusion_policy: exclusion.ExclusionPolicy | None
    node_rank: int | None


def node_options(conf: RendezvousSettings) -> NodeOptions:
    """The options every kind's handler takes from ``--rdzv-conf`` alike: how the job knows this
    node (``core.run.exclusion``: its host, and ``node_name``), when it is excluded, and its
    ``--node-rank``."""
    return {
        "identity": exclusion.node_identity(os.uname().nodename, conf.node_name),
        "exclusion_policy": exclusion.ExclusionPolicy(conf.exclude_after, conf.exclude_cooldown),
        "node_rank": conf.rank,
    }


class DynamicRendezvousHandler(RendezvousHandler):
    """Elastic membership on a shared store: join, complete, heartbeat, re-form, close.

    ``stores``: the node's connections, of one kind (``kinds``). ``on_shutdown``: what else to
    close on shutting down. ``identity``, ``exclusion_policy`` and ``store_host_probe``: see
    ``DynamicJob``. ``node_rank``: this node's place in the scheduler's order (``--node-rank``),
    which its group rank follows (``core.rendezvous.node_order``). ``death_notice``: what this
    node's guardian says should its agent die while a member (``death_notice``). ``token``: the
    job's (None: none), which its state copies are keyed from (``DynamicJob``). ``failover``: where
    the job's built-in store may move when its host is lost (``failover``). ``where``: the
    store in words, for the lines of a node waiting for others. ``seat``: where the store is,
    for what runs beside the rendezvous (``kinds.StoreSeat``). Deadlines come from ``clock``.
    """

    def __init__(
        self,
        run_id: str,
        stores: StoreKind,
        settings: plan.Settings,
        local_addr: str,
        backend: str = "c10d",
        on_shutdown: tuple[Callable[[], object], ...] = (),
        identity: str = "",
        exclusion_policy: exclusion.ExclusionPolicy | None = None,
        store_host_probe: Callable[[float], None] | None = None,
        node_rank: int | None = None,
        death_notice: DeathNotice | None = None,
        failover: StoreFailover | None = None,
        clock: Clock = SYSTEM_CLOCK,
        token: str | None = None,
        where: str = "",
        seat: StoreSeat | None = None,
    ) -> None:
        self._run_id = run_id
        #: Where the job's store is, for what runs beside the rendezvous (``kinds.StoreSeat``).
        self.seat = seat
        self._node_rank = node_rank
        self._death_notice = death_notice
        self._stores = stores
        self.settings = settings
        self._backend = backend
        self._clock = clock
        node_id = new_node_id()
        self._rounds = Rounds(run_id, stores, settings, local_addr, node_id, clock, where)
        # Presence checks are answered by the thread that watches the round, on its own connection.
        self._answers = stores.answers(self._rounds.key, node_id)
        self._on_shutdown = on_shutdown
        self._membership = NodeMembership(clock)
        # How the job knows this node across restarts (``core.run.exclusion``).
        self.identity = identity
        #: The job services this node offers the agent (``job.JobServices``).
        self.job = DynamicJob(
            run_id,
            stores,
            settings,
            self._rounds,
            self._membership,
            self.set_closed,
            identity,
            exclusion_policy,
            store_host_probe,
            death_notice,
            failover,
            clock,
            token,
        )
        self._failover = failover
        self._follow_lock, self._following = threading.Lock(), False  # ``_follow_first``
        if failover is not None:
            failover.guard(self._round_now, self._beat_key, settings, run_id)

    def _beat_key(self, round_: int, rank: int) -> str:
        """The heartbeat key of group rank ``rank`` in round ``round_``."""
        return self._rounds.key(f"hb/{rank}", round_)

    def _round_now(self) -> tuple[int, int, int] | None:
        """The running round, its member count and this node's group rank (None: none runs)."""
        membership = self._membership
        round_, final = membership.round, membership.final
        if round_ is None or final is None or membership.changed():
            return None
        return round_, final.count, membership.group_rank

    @classmethod
    def on_counters(
        cls,
        run_id: str,
        store: Store,
        settings: plan.Settings,
        local_addr: str,
        heartbeat_store: Store | None = None,
        watch_store: Store | None = None,
        clock: Clock = SYSTEM_CLOCK,
        **options: Unpack[HandlerOptions],
    ) -> DynamicRendezvousHandler:
        """The handler on the built-in store or the in-process one (``kinds.CounterKind``)."""
        stores = CounterKind(store, heartbeat_store, watch_store, clock)
        return cls(run_id, stores, settings, local_addr, clock=clock, **options)

    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._rounds.is_closed()

    def num_nodes_waiting(self) -> int:
        return self._rounds.waiting(self._membership.round)

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except StoreError as exc:
            self._membership.store_lost = True
            raise RendezvousConnectionError(f"rendezvous of job {self._run_id!r}: {exc}") from None

    def _next_rendezvous(self) -> RendezvousInfo:
        self.job.check_store()
        feed = self._stores.feed
        if feed is not None:
            feed.start()  # before joining: every later write it follows is seen
        try:
            self.job.leave_round()
        except StoreError as exc:
            # A connection that stalled while this node was cut off fails once, then the next
            # call reconnects (retrying for join_timeout): marking the old round is best effort.
            log.warning(
                "could not mark round %s for re-forming (%s); joining again",
                self._membership.round,
                exc,
            )
        membership = self._membership
        role, workers = membership.workers
        last = None if membership.round is None else (membership.round, membership.group_rank)
        round_, ticket, through, final = self._rounds.join(workers, role, last, self._node_rank)
        try:
            group_rank, offset = node_order.assign(final.placing, ticket, through, workers)
        except ValueError as exc:
            raise RendezvousError(f"rendezvous of job {self._run_id!r}: {exc}") from None
        previous = None if membership.final is None else membership.final.count
        membership.enter(round_, group_rank, final)
        if self._failover is not None and self._failover.hosting:
            self._failover.admit(final.count, previous)
            # Whom the others lose should this node's store go: they re-form without it.
            self._stores.store.set(self._rounds.key("store_host", round_), b"%d" % group_rank)
        if self._death_notice is not None:
            lost = MembershipChange.member_lost(group_rank, "its agent died", None)
            self._death_notice.leave(
                self._rounds.key("changed", round_),
                self._rounds.key("bell", round_),
                encode_change(lost, expected_size(final.count, lost)),
            )
        if feed is not None and round_ > 0:
            feed.forget(self._rounds.news_prefix(round_ - 1))
        role_offset, role_world_size = offset, final.world_size
        if final.roles:
            try:
                role_offset, role_world_size = role_place(final.roles, group_rank, role)
            except ValueError as exc:
                raise RendezvousError(f"rendezvous of job {self._run_id!r}: {exc}") from None
        self._start_watching()
        log.info(
            "rendezvous round %d complete: group rank %d of %d", round_, group_rank, final.count
        )
        return RendezvousInfo(
            self._stores.store,
            group_rank,
            final.count,
            RendezvousStoreInfo(final.master_addr, final.master_port),
            rank_offset=offset,
            global_world_size=final.world_size,
            role_rank_offset=role_offset,
            role_world_size=role_world_size,
        )

    def set_closed(self, failure: MembershipChange | None = None) -> None:
        """Mark the job finished, so late nodes exit rather than wait (``StoreKind.close_job``:
        a kind may delete the job's keys then); ``failure``: the one that ended it, kept in the
        ``closed`` record (``rounds.closed_record``)."""
        membership = self._membership
        if membership.finished:
            return
        membership.finished = True
        round_ = membership.round or 0
        try:
            if self._rounds.is_closed():
                return  # another node closed it (and cleaned up)
            self._stores.close_job(
                self._rounds.key,
                round_ + 1,
                self.settings.join_timeout,
                self._mark_finished,
                closed_record(failure),
            )
        except StoreError as exc:
            log.debug("could not mark the rendezvous closed: %s", exc)

    def _mark_finished(self) -> None:
        """Supersede the running round with the job's end: its members stop."""
        membership = self._membership
        if membership.round is not None and membership.final is not None:
            finished = MembershipChange.finished()
            self._rounds.supersede(
                membership.round, finished, expected_size(membership.final.count, finished)
            )

    def shutdown(self) -> bool:
        if self._death_notice is not None:
            self._death_notice.retract()
        membership = self._membership
        membership.stop_watching()
        if self._stores.feed is not None:
            self._stores.feed.close()
        if (
            membership.round is not None
            and membership.final is not None
            and not membership.finished
            and not membership.store_lost
            and not membership.ended  # the job is over: nobody re-forms, and its keys may be gone
        ):
            try:
                # Leaving before the job finished: the others re-form without this node. This
                # also wakes this node's own watcher, so its connection can close.
                left = MembershipChange.member_left(membership.group_rank)
                self._rounds.supersede(
                    membership.round, left, expected_size(membership.final.count, left)
                )
            except StoreError:
                pass
        if not membership.store_lost:
            self._stores.release()
        stores = self._stores
        for close in (stores.heartbeat_store.close, stores.store.close, *self._on_shutdown):
            try:
                close()
            except Exception:  # shutting down: note it and go on
                log.debug("error while shutting down the rendezvous", exc_info=True)
        return True

    def _flag(self, round_: int, change: MembershipChange, recorded: bool) -> None:
        """A change the round's watch noticed. When the store was lost and may move, the calls
        still waiting on it (a status post, say) end now rather than at their deadline: the
        agent's teardown must not wait for a silent host. A replica group's node follows the
        store first (``_follow_first``)."""
        failover = self._failover
        lost = failover is not None and change.kind is ChangeKind.STORE_LOST
        if lost and self._follow_first(round_, change):
            return
        self._membership.flag(round_, change, recorded)
        if failover is not None and lost:
            failover.cut_off()

    def _follow_first(self, round_: int, change: MembershipChange) -> bool:
        """A replica group's node that lost the store every group shares: follow it where it
        moves (``DynamicJob.follow_store``, on a thread of its own) before the agent hears of
        the loss. The agent hears it only if the store did not move; a group whose round the
        lost host was in re-forms when the move supersedes that round, and the others go on,
        their round watched anew on the moved store. False for any other node."""
        from relaunch.core.run.replica_groups import job_of_group

        if job_of_group(self._run_id) is None:
            return False
        with self._follow_lock:
            if self._following:
                return True
            self._following = True
        assert self._failover is not None
        self._failover.cut_off()
        start_thread(self._follow, "relaunch-store-follow", round_, change)
        return True

    def _follow(self, round_: int, change: MembershipChange) -> None:
        membership = self._membership
        try:
            if not self.job.follow_store():
                membership.flag(round_, change, False)
            elif membership.round == round_ and not membership.changed():
                membership.stop_watching()  # its threads ended on the lost store, or end now
                self._start_watching()  # a change written on the moved store is seen there
        finally:
            with self._follow_lock:
                self._following = False

    def _start_watching(self) -> None:
        """Watch the round just joined: heartbeats, the neighbour's, and the round's signal."""
        membership = self._membership
        round_ = membership.round
        assert round_ is not None and membership.final is not None
        membership.watch = RoundWatch(
            lambda name: self._rounds.key(name, round_),
            membership.group_rank,
            membership.final.count,
            self.settings,
            self._stores,
            lambda change, recorded: self._flag(round_, change, recorded),
            lambda: self._answers.mark("here", round_),
            self._clock,
        )
        membership.watch.start()
