"""What a node of the dynamic rendezvous does once it lost its store (``DynamicJob.check_store``).

A store that answers again was a blip. On c10d with one endpoint, a store whose host refuses
the connection is gone with it (``StoreHostGone``), and one that answers nothing is waited for
as a rejoin waits. With several endpoints (``failover``) the store may move: the node votes for
the first named standby, moves its connections there and re-forms the round without the lost
host, or stops when its own store lost the job's majority.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch.core.durations import seconds
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import MembershipChange, expected_size
from relaunch.rendezvous.api import StoreHostGone
from relaunch.rendezvous.node_membership import NodeMembership
from relaunch.rendezvous.rounds import Rounds
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import Store, StoreError, StoreFenced, StoreRefused

if TYPE_CHECKING:
    from relaunch.rendezvous.failover import StoreFailover

log = logging.getLogger(__name__)

#: How long a lost store's primary gets to answer before a failover asks a standby.
CHECK_PRIMARY_S = 0.5
#: How a job whose built-in store has one host survives losing it: both ways.
SURVIVE_A_HOST = (
    "name several hosts in --rdzv-endpoint (with a token and 3 nodes or more, the store moves "
    "to another), or run it with --rdzv-backend etcd"
)


class StoreLoss:
    """The store-loss checks of one node of job ``run_id`` (its ``membership``, ``settings``,
    ``rounds`` and its requests' ``store`` connection). ``probe`` (c10d, the store hosted by
    another node) reaches the store within the seconds given, or raises ``StoreError``;
    ``failover``: where the store may move (None: nowhere). Deadlines come from ``clock``."""

    def __init__(
        self,
        run_id: str,
        membership: NodeMembership,
        settings: plan.Settings,
        rounds: Rounds,
        store: Store,
        probe: Callable[[float], None] | None,
        failover: StoreFailover | None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._run_id, self._membership, self._settings = run_id, membership, settings
        self._rounds, self._store = rounds, store
        self._probe, self._failover = probe, failover
        self._clock = clock
        self._store_unanswered_said = False
        self._following = threading.Lock()  # one node follows the store on one thread at once
        self._gone: StoreHostGone | None = None  # what ``follow`` found: the store is gone

    def follow(self) -> bool:
        """A replica group's node lost the store it shares with the other groups: move with it
        now, off the agent's thread and before the agent hears of the loss, so that a group
        whose round the store's host was not in goes on without a restart. Whether the store
        serves again (it answered, or moved); when it is gone, ``check`` raises that."""
        assert self._failover is not None
        with self._following:
            if self._membership.store_lost_at is None:
                self._membership.store_lost_at = self._clock.monotonic()
            try:
                self._follow_the_store(self._failover)
            except StoreHostGone as exc:
                self._gone = exc
                return False
        return self._membership.store_lost_at is None

    def check(self) -> None:
        """After the store was lost: whether it still lives, judged as a member is, by the
        keep-alive detection time (``dead_after``) since the loss. ``StoreHostGone`` when its
        host refuses the connection all that time: on c10d the store lives in the agent that
        hosted it, and dies with it. A store that answers nothing at all (this node cut off, or
        the host down) is waited for as a rejoin waits, up to ``join_timeout``: said once."""
        membership, probe = self._membership, self._probe
        if self._gone is not None:
            raise self._gone
        lost_at = membership.store_lost_at
        if lost_at is None:
            return
        if self._failover is not None:
            with self._following:
                if membership.store_lost_at is not None:  # ``follow`` may have moved it since
                    self._follow_the_store(self._failover)
            return
        if probe is None:
            return
        settings = self._settings
        left = lost_at + settings.dead_after - self._clock.monotonic()
        try:
            probe(max(left, settings.keep_alive_interval))
        except StoreError as exc:
            self._store_unanswered(exc, SURVIVE_A_HOST)
            return
        membership.store_lost_at, self._store_unanswered_said = None, False  # it answers: a blip

    def _store_unanswered(self, exc: StoreError, to_survive: str) -> None:
        """The store was lost and does not answer: ``StoreHostGone`` when its host refuses
        the connection (saying how ``to_survive`` it), said once and waited for otherwise."""
        if isinstance(exc, StoreRefused):
            self._membership.store_lost = self._membership.finished = True  # nothing to write
            raise StoreHostGone(
                f"the rendezvous store's host is gone ({exc}): the node that hosted the store "
                "for job "
                f"{self._run_id!r} stopped or died, and a c10d store does not outlive its host; "
                f"restart the job, and to survive the loss of any node, {to_survive}"
            ) from None
        if not self._store_unanswered_said:
            self._store_unanswered_said = True
            log.warning(
                "the rendezvous store does not answer (%s): this node may be cut off from "
                "its host, or the host may be down; trying to rejoin for up to %s "
                "(join_timeout)",
                exc,
                seconds(self._settings.join_timeout),
            )

    def _follow_the_store(self, failover: StoreFailover) -> None:
        gone = False
        try:
            self._find_the_store(failover)
        except StoreHostGone:
            gone = True  # for good: its connections stay cut off, so no thread of this node
            raise  # spends its connect timeout (join_timeout) redialling the dead host
        finally:
            if not gone:
                failover.resume()  # moved, a blip, or waited for: the connections may call again

    def _find_the_store(self, failover: StoreFailover) -> None:
        """``check_store`` when the store may move (``failover``): a primary that answers was
        a blip; one that is gone is replaced by the first named standby, once a majority of
        the last round's members ask it to take over, and the round re-forms without the lost
        host. ``StoreHostGone`` when this node's own store lost the job's majority, or the
        store's host refuses and no majority moved the store."""
        membership, settings = self._membership, self._settings
        try:
            # Quick: a store silent this long is lost (its host's silence was timed already).
            failover.check_primary(min(settings.keep_alive_interval, CHECK_PRIMARY_S))
        except StoreFenced:
            raise self.fenced_out() from None
        except StoreError as exc:
            lost = exc
        else:
            membership.store_lost_at, self._store_unanswered_said = None, False  # a blip
            return
        round_, final = membership.round, membership.final
        members = 0 if final is None or round_ is None else final.count
        group = self._group_run_id()  # a replica group's member votes with the whole job's
        if failover.hosting or round_ is None or (members < 3 and group is None):
            self._store_unanswered(lost, "run 3 nodes or more (a majority moves the store)")
            return
        from relaunch.rendezvous.failover import format_endpoint, voter_name

        old = format_endpoint(failover.primary)
        within = settings.dead_after + settings.keep_alive_interval
        moved = failover.take_over(voter_name(round_, membership.group_rank, group), within)
        if moved is None:
            self._store_unanswered(
                lost,
                "make sure a majority of the nodes can reach each other"
                if group is None
                else "run 3 nodes or more in all the replica groups, a majority of them able "
                "to reach each other (they move the store)",
            )
            return
        membership.store_lost_at, self._store_unanswered_said = None, False
        reforms = self._supersede_for_lost_host(members)
        log.warning(
            "the rendezvous store's host %s is gone (%s): the store moved to %s, and %s",
            old,
            lost,
            format_endpoint(moved),
            "the job re-forms without it"
            if reforms
            else "this replica group goes on (the host was another group's node)",
        )

    def fenced_out(self) -> StoreHostGone:
        """This node's store lost the job's majority (``failover.MajorityWatch``): the error
        this node stops with."""
        self._membership.store_lost = self._membership.finished = True
        return StoreHostGone(
            f"this node lost the majority of job {self._run_id!r}: its store serves nobody "
            "now (the other nodes moved the store to another host, or cannot go on); "
            "it stops here"
        )

    def _group_run_id(self) -> str | None:
        """This rendezvous' run id when it is a replica group's (``RUN_ID-group{g}``), whose
        members vote on the store's failover with every group's (``failover_groups``)."""
        from relaunch.core.run.replica_groups import job_of_group

        return self._run_id if job_of_group(self._run_id) is not None else None

    def _supersede_for_lost_host(self, members: int) -> bool:
        """Re-form the running round without the store's lost host (the group rank it said
        under ``store_host``); the first node to write it wins. False when the round goes on: a
        replica group's round that the host was not a member of."""
        membership, round_ = self._membership, self._membership.round
        if round_ is None:
            return True
        reason = "the store's host is gone"
        try:
            raw = self._store.get(self._rounds.key("store_host", round_)).value
            if raw is None and self._group_run_id() is not None:
                return False  # another replica group's node hosted it
            host = int(raw) if raw is not None and raw.isdigit() else None
            change = (
                MembershipChange.member_lost(host, reason, membership.group_rank)
                if host is not None and host != membership.group_rank
                else MembershipChange.restarting(reason)
            )
            waiting = self._rounds.waiting(round_)
            self._rounds.supersede(round_, change, expected_size(members, change, waiting))
        except StoreError as exc:
            log.warning("could not re-form round %d after the store moved: %s", round_, exc)
        return True
