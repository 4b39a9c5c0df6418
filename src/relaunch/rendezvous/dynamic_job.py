"""The job services (``job.JobServices``) of a node of the dynamic rendezvous: what the nodes of
one job share through its store beside joining rounds.

The restart budget (``relaunch/{run_id}/restarts``, added to by the node whose failure re-formed a
round), the presence check (``presence``), the job's failure and stack requests (a change record
that supersedes the running round), the notes of a round, the exit barrier, the wait for the job's
end, and exclusion: a node whose failures re-form the job too often is excluded for a while
(``core.run.exclusion``); its record is ``relaunch/{run_id}/nodes/{identity}``, which only that node
writes. The handler (``dynamic``) joins the rounds; both share the node's
``node_membership.NodeMembership``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from relaunch.core.durations import seconds
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange, expected_size
from relaunch.core.run import exclusion
from relaunch.core.sections import Learned, decode_learned, encode_learned, merge
from relaunch.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    store_int,
    store_record,
)
from relaunch.rendezvous.death_notice import DeathNotice
from relaunch.rendezvous.job import ChangeListener, check_workers
from relaunch.rendezvous.kinds import StoreKind
from relaunch.rendezvous.node_membership import NodeMembership
from relaunch.rendezvous.presence import presence_check
from relaunch.rendezvous.rounds import Rounds, closing_failure
from relaunch.rendezvous.store_loss import StoreLoss
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store import auth
from relaunch.store.api import StoreConnectionError, StoreError, StoreFenced

if TYPE_CHECKING:
    from relaunch.rendezvous.failover import StoreFailover

log = logging.getLogger(__name__)


class DynamicJob:
    """The job services of one node of job ``run_id``, over its ``rounds`` on ``stores``.
    ``close`` closes the job (the handler's ``set_closed``, given the failure that ends it).
    ``identity`` is how the job knows this node across restarts, and ``exclusion_policy`` when
    it excludes it (None: never).
    ``store_host_probe`` (c10d, the store hosted by another node) reaches the store within the
    seconds given, or raises ``StoreError``: once the store is lost, a store that cannot be
    reached within the keep-alive detection time is judged dead with its host, as a member
    silent that long is. ``token``: the job's (None: none), which ``peer_key`` is derived
    from. Deadlines and timestamps come from ``clock``."""

    watches_membership = True
    pushes_changes = True

    def __init__(
        self,
        run_id: str,
        stores: StoreKind,
        settings: plan.Settings,
        rounds: Rounds,
        membership: NodeMembership,
        close: Callable[[MembershipChange | None], None],
        identity: str = "",
        exclusion_policy: exclusion.ExclusionPolicy | None = None,
        store_host_probe: Callable[[float], None] | None = None,
        death_notice: DeathNotice | None = None,
        failover: StoreFailover | None = None,
        clock: Clock = SYSTEM_CLOCK,
        token: str | None = None,
    ) -> None:
        self._run_id = run_id
        self._death_notice = death_notice
        #: What the nodes' state copies prove (``job.JobServices.peer_key``).
        self.peer_key = None if token is None else auth.derived(token, f"state copies {run_id}")
        self._stores, self._store = stores, stores.store
        self.settings = settings
        self._rounds, self._key, self._roster = rounds, rounds.key, rounds.roster
        #: The address the other nodes reach this one at (its workers' MASTER_ADDR when it
        #: hosts rank 0, its state peer server's).
        self.local_addr: str | None = rounds.local_addr
        self._membership = membership
        self._close = close
        self.identity = identity
        self._exclusion = exclusion_policy
        self._loss = StoreLoss(
            run_id, membership, settings, rounds, stores.store, store_host_probe, failover, clock
        )
        self._clock = clock
        self._restarts_seen = 0
        #: Why this node was evicted as a straggler (None: it was not), and until when it stays
        #: out (``clock.time()``): this agent's own, not its identity's record, which agents
        #: sharing a host share.
        self.evicted: str | None = None
        self._evicted_until = 0.0
        #: Why ``prepare_join`` last found this node excluded.
        self.exclusion_reason = ""

    # -- the membership change ----------------------------------------------------------------

    @property
    def lost_node_grace(self) -> float:
        return self._stores.lost_node_grace(self.settings)

    def set_change_listener(self, listener: ChangeListener | None) -> None:
        self._membership.set_listener(listener)

    def membership_change(self) -> MembershipChange | None:
        return self._membership.change

    def leave_death_notice_with(self, send: Callable[[str | None], None]) -> None:
        if self._death_notice is not None:
            self._death_notice.send_to(send)

    def wait_membership_change(self, timeout: float) -> MembershipChange | None:
        """``membership_change()``, waiting up to ``timeout`` seconds for one."""
        self._membership.wait_change(timeout)
        return self.membership_change()

    # -- leaving a round, and joining again ---------------------------------------------------

    def set_workers(self, role: str, local_world_size: int) -> None:
        """This node joins its next rounds with ``local_world_size`` workers of ``role``."""
        self._membership.workers = (role, check_workers(role, local_world_size))

    def prepare_join(self) -> float | None:
        """Leave the running round (the others re-form at once), then say until when this node
        is excluded from the job (``clock.time()``), or None when it may join."""
        self.check_store()
        self._leave_or_warn()
        self._heed_eviction()
        now = self._clock.time()
        evicted = self._evicted_until if self._evicted_until > now else None
        failed = None
        if self._exclusion is not None:
            try:
                key = self._node_key()
                record = store_record(key, self._store.get(key).value)
                failed = exclusion.excluded_until(record, now)
            except StoreError as exc:
                log.debug("could not read this node's record: %s", exc)  # joining reports it
        if failed is not None and (evicted is None or failed > evicted):
            self.exclusion_reason = "it failed the job too often"
            return failed
        self.exclusion_reason = "evicted as a straggler"
        return evicted

    def leave_early(self) -> None:
        if self._membership.store_lost_at is not None:
            return
        try:
            self._leave_or_warn()
        except RendezvousClosedError:
            pass  # the join says so

    def _leave_or_warn(self) -> None:
        try:
            self.leave_round()
        except StoreError as exc:
            log.warning("could not mark round %s for re-forming (%s)", self._membership.round, exc)

    def leave_round(self) -> None:
        """Before joining again: mark the current round as re-formed, so others follow. When
        this node's own failure re-forms it, the failure counts against the node, and may
        exclude it: the others then re-form without waiting for it."""
        membership = self._membership
        membership.stop_watching()
        if membership.round is None or membership.final is None or membership.left:
            return
        membership.left = True
        change, spending, recorded = membership.leave()
        if recorded:
            return  # the round's record says it already: O(1) requests for the followers
        if self._rounds.is_closed():
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        waiting = self._rounds.waiting(membership.round)
        others = membership.final.count - 1 + waiting  # the next round, should this node be out
        read = self._read_record() if spending and self._exclusion is not None else None
        counted = None if read is None else self._counted(read[0], others)
        if (
            read is not None
            and counted is not None
            and counted.excluded_until > read[0].excluded_until
        ):
            until = time.strftime("%H:%M:%S", time.localtime(counted.excluded_until))
            change = MembershipChange.member_excluded(
                membership.group_rank,
                f"node {self.identity} (group rank {membership.group_rank}) is excluded until "
                f"{until}, having failed the job {read[0].failures + 1} times ({change.reason})",
            )
        won = self._rounds.supersede(
            membership.round, change, expected_size(membership.final.count, change, waiting)
        )
        if won and spending:  # one group restart, one unit, whoever else failed with it
            self._store.add(self._key("restarts", None), 1)
            if read is not None and counted is not None:
                self._write_record(counted, read[1], others)

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the job to finish; whether it has."""
        closed = self._key("closed", None)
        deadline = self._clock.monotonic() + timeout
        feed = self._stores.feed
        try:
            if feed is not None:
                feed.start()  # from here on, the close is heard when written
            if self._rounds.is_closed():
                return True
            while (left := deadline - self._clock.monotonic()) > 0:
                # In steps: one store call never waits longer than a keep-alive interval.
                step = min(left, self.settings.keep_alive_interval)
                if self._stores.news.watch(closed, 0, step).value is not None:
                    return True
            return self._rounds.is_closed()
        except StoreError as exc:
            raise RendezvousConnectionError(f"rendezvous of job {self._run_id!r}: {exc}") from None

    def check_store(self) -> None:
        """After the store was lost: whether it lives, or moved (``store_loss.StoreLoss``)."""
        self._loss.check()

    def follow_store(self) -> bool:
        """The store was lost and may move: follow it now (``StoreLoss.follow``); whether it
        serves again."""
        return self._loss.follow()

    # -- the restart budget, the presence check, the job's failure ---------------------------------

    def note_restart(self, reason: str) -> None:
        self._membership.restart_reason = reason
        self._membership.spending = True

    def share_learned(self, learned: Learned) -> Learned:
        """Merge ``learned`` into the job's table (``relaunch/{run_id}/learned``, a
        compare-and-set, tried a few times when nodes write at once) and return the job's;
        ``learned`` alone when the store cannot be reached. A table that is not relaunch's is
        written over, with one warning."""
        key = self._key("learned", None)
        try:
            for _ in range(8):
                stored = self._store.get(key)
                kept = Learned()
                if stored.value is not None:
                    try:
                        kept = decode_learned(stored.value)
                    except ValueError as exc:
                        log.warning(
                            "the job's learned bounds under %s are not relaunch's (%s): "
                            "writing them anew",
                            key,
                            exc,
                        )
                merged = merge(kept, learned)
                if merged == kept:
                    return kept
                record = encode_learned(merged).encode()
                if self._store.compare_set(key, stored.version, record).succeeded:
                    return merged
        except StoreError as exc:
            log.warning("could not share the learned bounds through the store: %s", exc)
        return learned

    def restarts_used(self, spent_here: int) -> int:
        """The job's count in the store (``relaunch/{run_id}/restarts``), which the node whose
        failure re-formed a round adds to; the last count read if the store cannot be read."""
        key = self._key("restarts", None)
        try:
            value = self._store.get(key).value
        except StoreError as exc:
            log.warning("could not read the job's restart count: %s", exc)
        else:
            self._restarts_seen = store_int(key, value)
        return self._restarts_seen

    def peers_alive(self, timeout: float) -> bool | None:
        """A presence check of the running round (``presence``): True when every member answered
        within ``timeout``."""
        round_, final = self._membership.round, self._membership.final
        if round_ is None or final is None:
            return None
        try:
            return presence_check(
                self._store, self._roster, self._key, round_, final.count, timeout
            )
        except StoreError as exc:
            log.warning("presence check of round %d: %s", round_, exc)
            return None

    def stop_for_stacks(self, reason: str) -> None:
        """Mark the round re-formed now, asking its members for their workers' stacks, and count
        the group restart this node's hang spends (``leave_round`` will find the record)."""
        membership = self._membership
        if membership.round is None or membership.final is None or membership.finished:
            return
        change = MembershipChange.restarting(reason, stacks=True)
        try:
            waiting = self._rounds.waiting(membership.round)
            won = self._rounds.supersede(
                membership.round, change, expected_size(membership.final.count, change, waiting)
            )
            if won:
                self._store.add(self._key("restarts", None), 1)
        except StoreError as exc:
            log.warning("could not ask the other nodes for their workers' stacks: %s", exc)

    def fail_job(self, reason: str, stacks: bool = False, requeue: bool = True) -> None:
        """Mark the round failed (its members stop and report it, rather than re-form), then
        close the job."""
        membership = self._membership
        failed = MembershipChange.failed(reason, stacks, requeue)
        if (
            membership.round is not None
            and membership.final is not None
            and not membership.finished
        ):
            try:
                self._rounds.supersede(
                    membership.round, failed, expected_size(membership.final.count, failed)
                )
            except StoreConnectionError as exc:
                # The store is gone or out of reach (its host failed the job too, say): closing
                # the job there would wait for it up to join_timeout, for nobody. The other
                # nodes learn of this one from its silence.
                log.warning("could not tell the other nodes that the job failed: %s", exc)
                membership.store_lost = membership.finished = True
            except StoreError as exc:
                log.warning("could not tell the other nodes that the job failed: %s", exc)
        self._close(failed)

    def closing_failure(self) -> MembershipChange | None:
        """The failure that closed the job, if one did: what a node that re-formed meanwhile
        ends with (the round's own record of it may be gone, or superseded before it)."""
        key = self._key("closed", None)
        try:
            return closing_failure(self._store.get(key).value)
        except (StoreError, ValueError) as exc:
            log.warning("could not read why the job ended from %s: %s", key, exc)
            return None

    # -- notes, and the exit barrier ----------------------------------------------------------

    def post_note(self, name: str, value: bytes) -> None:
        round_ = self._membership.round
        if round_ is None:
            return
        try:
            self._store.set(self._key(f"notes/{name}", round_), value)
        except StoreError as exc:
            log.debug("could not post the note %r: %s", name, exc)

    def read_notes(self, names: Sequence[str]) -> dict[str, bytes]:
        round_, notes = self._membership.round, dict[str, bytes]()
        if round_ is None:
            return notes
        try:
            for name, value in self._stores.read_notes(self._key("notes/", round_), names):
                notes[name] = value
        except StoreError as exc:
            log.debug("could not read the notes: %s", exc)
        return notes

    def gather(
        self, name: str, rank: int, count: int, value: bytes, timeout: float
    ) -> dict[int, bytes] | None:
        round_ = self._membership.round
        if round_ is None:
            return None
        names = [f"{name}/{member}" for member in range(count)]
        prefix = self._key("notes/", round_)
        try:
            self._store.set(prefix + names[rank], value)
            self._store.wait([prefix + part for part in names], timeout)
            parts = dict(self._stores.read_notes(prefix, names))
        except (StoreError, TimeoutError) as exc:
            log.warning("could not gather the note %r of every node: %s", name, exc)
            return None
        if len(parts) != count:
            return None
        return {member: parts[part] for member, part in enumerate(names)}

    def exit_barrier(self, timeout: float) -> None:
        """Count this node done; group rank 0 waits for every member, then closes the job,
        which is what the others wait for. O(1) store operations a node, and no event that
        reaches every node but the one ``closed`` record. Ends early when a member is lost."""
        membership = self._membership
        if membership.round is None or membership.final is None:
            return
        round_, members = membership.round, membership.final.count
        deadline = self._clock.monotonic() + timeout
        interval = self.settings.keep_alive_interval
        try:
            self._roster.mark("done", round_)
            closed = self._key("closed", None)
            while not membership.changed():  # a member was lost: the live ones are done
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    log.warning("exit barrier: not every node finished within %s", seconds(timeout))
                    return
                if membership.group_rank == 0:
                    done = self._roster.await_tally("done", round_, members, min(left, interval))
                    if done >= members:
                        return
                elif self._stores.news.watch(closed, 0, min(left, interval)).value is not None:
                    return
        except StoreConnectionError:
            membership.finished = True  # the hosting node finished and left: everyone is done
        except StoreFenced:
            raise self._loss.fenced_out() from None

    # -- evicting this node as a straggler (``core.workers.eviction``) ----------------------------

    @property
    def min_nodes(self) -> int:
        return self.settings.min_nodes

    def spares(self) -> int:
        try:
            return self._rounds.waiting(self._membership.round)
        except StoreError as exc:
            log.debug("could not count the nodes waiting to join: %s", exc)
            return 0

    def evict(self, node_rank: int, reason: str) -> None:
        """Evict the member of group rank ``node_rank`` as a straggler: the round re-forms with
        the spare waiting in its place, which every member sees at once (the member evicted
        too: it stays out for the cooldown, ``_heed_eviction``). ``reason``: the line every
        node shows."""
        membership = self._membership
        if membership.round is None or membership.final is None:
            return
        if membership.finished or membership.left or membership.changed():
            return
        change = MembershipChange.member_evicted(node_rank, reason, membership.group_rank)
        try:
            waiting = self._rounds.waiting(membership.round)
            self._rounds.supersede(
                membership.round, change, expected_size(membership.final.count, change, waiting)
            )
        except StoreError as exc:
            log.warning("could not evict node %d as a straggler: %s", node_rank, exc)

    def _heed_eviction(self) -> None:
        """Once the change that re-formed this node's round evicted it: out of the job for the
        exclusion cooldown (this agent alone: another agent on its host is not the straggler)."""
        change, membership = self._membership.change, self._membership
        if self.evicted is not None or change is None or membership.final is None:
            return
        if change.kind is ChangeKind.MEMBER_EVICTED and change.member == membership.group_rank:
            self.evicted = change.reason
            cooldown = (self._exclusion or exclusion.ExclusionPolicy()).cooldown
            self._evicted_until = self._clock.time() + cooldown

    # -- this node's record (``core.run.exclusion``) ----------------------------------------------

    def _node_key(self) -> str:
        return self._key(f"nodes/{self.identity}", None)

    def _read_record(self) -> tuple[exclusion.NodeRecord, int]:
        key = self._node_key()
        stored = self._store.get(key)
        return store_record(key, stored.value), stored.version

    def _counted(self, record: exclusion.NodeRecord, others: int) -> exclusion.NodeRecord:
        """``record`` once one more failure of this node counts (``core.run.exclusion``)."""
        assert self._exclusion is not None
        return exclusion.after_failure(
            record, self._exclusion, self._clock.time(), others, self.settings.min_nodes
        )

    def _write_record(self, record: exclusion.NodeRecord, version: int, others: int) -> None:
        """Store this node's ``record`` over the version read. Only this node writes it; should
        two agents have been given one identity, the failure is counted again on the other's."""
        key = self._node_key()
        for _ in range(8):
            if self._store.compare_set(key, version, exclusion.encode_record(record)).succeeded:
                return
            current, version = self._read_record()
            record = self._counted(current, others)
