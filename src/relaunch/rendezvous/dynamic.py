"""The dynamic rendezvous handler: elastic membership on a shared ``Store``.

It joins rounds (``rounds``), watches the running one (``heartbeat``), and re-forms it when its
membership changes (``core.membership``); ``backends`` builds it from the ``--rdzv-*`` flags.
A node whose failures re-form the job too often is excluded for a while (``core.exclusion``):
its record is ``relaunch/{run_id}/nodes/{identity}``, which only that node writes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from relaunch.core import exclusion
from relaunch.core import rendezvous as plan
from relaunch.core.durations import seconds
from relaunch.core.membership import ChangeKind, MembershipChange, expected_size
from relaunch.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    StoreHostGone,
    store_int,
    store_record,
)
from relaunch.rendezvous.heartbeat import NodeLease, RoundWatch
from relaunch.rendezvous.rollcall import roll_call
from relaunch.rendezvous.roster import new_node_id, roster_for
from relaunch.rendezvous.rounds import CLOSED, Rounds, news_prefix
from relaunch.runtime import report_failure
from relaunch.store.api import (
    Store,
    StoreConnectionError,
    StoreError,
    StoreRefused,
    Watchable,
)

if TYPE_CHECKING:
    from relaunch.store.etcd import EtcdStore
    from relaunch.store.etcd_feed import PrefixFeed

log = logging.getLogger(__name__)


class DynamicRendezvousHandler(RendezvousHandler):
    """Elastic membership on a shared store: join, complete, heartbeat, re-form, close."""

    def __init__(
        self,
        run_id: str,
        store: Store,
        settings: plan.Settings,
        local_world_size: int,
        local_addr: str,
        heartbeat_store: Store,
        backend: str = "c10d",
        on_shutdown: tuple[Any, ...] = (),
        watch_store: Store | None = None,
        leases: bool = False,
        identity: str = "",
        exclusion_policy: exclusion.ExclusionPolicy | None = None,
        store_host_probe: Callable[[float], None] | None = None,
    ) -> None:
        self._run_id = run_id
        # c10d, the store hosted by another node: reaches it within the seconds given, or
        # raises StoreError. Once the store is lost (``_store_lost_at``), a store that cannot
        # be reached within the keep-alive detection time is judged dead with its host, as a
        # member silent that long is.
        self._store_host_probe = store_host_probe
        self._store_lost_at: float | None = None
        self._store_unanswered_said = False
        self._store = store
        self._hb_store = heartbeat_store
        self._watch_store = watch_store
        # On etcd, this node's heartbeat lease, from its first round to its shutdown.
        self._lease = (
            NodeLease(cast("EtcdStore", heartbeat_store), settings.dead_after) if leases else None
        )
        if leases:
            # A beat is due each keep-alive interval, and the lease lasts only dead_after: a
            # renewal that sits on one member longer than an interval (a member waiting out a
            # leader election, or cut off from the others) would let the lease expire while
            # another member could take it, and this node would look lost to its neighbour,
            # which reached etcd all along. Each attempt is left after an interval for the next
            # member; the beat as a whole still has the store's timeout.
            cast("EtcdStore", heartbeat_store).attempt_timeout = settings.keep_alive_interval
        self.settings = settings
        self._local_world_size = local_world_size
        self._backend = backend
        node_id = new_node_id()
        # On etcd, what every node waits for comes through one watch a node (``etcd_feed``).
        self._feed: PrefixFeed | None = None
        if leases:
            from relaunch.store.etcd_feed import PrefixFeed

            self._feed = PrefixFeed(
                cast("EtcdStore", watch_store or heartbeat_store),
                news_prefix(run_id),
                settings.dead_after,  # a stream silent that long is checked: one read
            )
        self._rounds = Rounds(
            run_id, store, settings, local_addr, node_id, keyed=leases, news=self._feed
        )
        self._roster = self._rounds.roster
        self._key = self._rounds.key
        self._news: Watchable = self._feed or store
        # Roll calls are answered by the thread that watches the round, on its own connection.
        self._answers = roster_for(watch_store or heartbeat_store, self._key, node_id, leases)
        self._on_shutdown = on_shutdown
        self._round: int | None = None
        self._ticket = 0
        self._final: plan.Final | None = None
        self._change: MembershipChange | None = None
        self._change_recorded = False  # whether ``_change`` came from the round's record
        self._change_lock = threading.Lock()  # guards _change, _listener, and _round's update
        self._changed = threading.Event()
        self._listener: Callable[[], None] | None = None
        self._watch: RoundWatch | None = None
        # Set once the job is over for this node (closed, or its store gone with the node that
        # hosted it): from then on nothing more is written, and nothing waits to reconnect.
        self._finished = False
        # Set once the store could not be reached within the deadlines: shutting down then
        # writes nothing (it would only wait for the store again).
        self._store_lost = False
        self._restart_reason = ""
        # Whether this node's next re-form is its own restart after a failure, which spends
        # one of the job's restarts (``restarts``) if its change is the one that stands.
        self._spending = False
        self._restarts_seen = 0
        # How the job knows this node across restarts (``core.exclusion``), and when it excludes
        # it (no policy: never). ``_left``: this node left its round (``prepare_join``).
        self.identity = identity
        self._exclusion = exclusion_policy
        self._left = False

    # -- RendezvousHandler ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def watches_membership(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return self._rounds.is_closed()

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except StoreError as exc:
            self._store_lost = True
            raise RendezvousError(f"rendezvous of job {self._run_id!r}: {exc}") from None

    def _next_rendezvous(self) -> RendezvousInfo:
        self._check_store_host()
        if self._feed is not None:
            self._feed.start()  # before joining: every later write it follows is seen
        try:
            self._leave_round()
        except StoreError as exc:
            # A connection that stalled while this node was cut off fails once, then the next
            # call reconnects (retrying for join_timeout): marking the old round is best effort.
            log.warning(
                "could not mark round %s for re-forming (%s); joining again", self._round, exc
            )
        round_, ticket, through, final = self._rounds.join(self._local_world_size)
        with self._change_lock:
            self._round, self._ticket, self._final = round_, ticket, final
            self._change, self._change_recorded = None, False
            self._changed.clear()
            self._left = False
        if self._feed is not None and round_ > 0:
            self._feed.forget(self._rounds.news_prefix(round_ - 1))
        group_rank, offset = plan.assign(ticket, through, self._local_world_size)
        self._start_watching()
        log.info(
            "rendezvous round %d complete: group rank %d of %d", round_, group_rank, final.count
        )
        return RendezvousInfo(
            group_rank=group_rank,
            group_world_size=final.count,
            master_addr=final.master_addr,
            master_port=final.master_port,
            rank_offset=offset,
            world_size=final.world_size,
            store=self._store,
        )

    def prepare_join(self) -> float | None:
        """Leave the running round (the others re-form at once), then say until when this node
        is excluded from the job (``time.time()``), or None when it may join."""
        self._check_store_host()
        try:
            self._leave_round()
        except StoreError as exc:
            log.warning("could not mark round %s for re-forming (%s)", self._round, exc)
        if self._exclusion is None:
            return None
        try:
            key = self._node_key()
            record = store_record(key, self._store.get(key).value)
        except StoreError as exc:
            log.debug("could not read this node's record: %s", exc)
            return None  # joining reports an unreachable store
        return exclusion.excluded_until(record, time.time())

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the job to finish; whether it has."""
        closed, deadline = self._key("closed"), time.monotonic() + timeout
        try:
            if self._feed is not None:
                self._feed.start()  # from here on, the close is heard when written
            if self.is_closed():
                return True
            while (left := deadline - time.monotonic()) > 0:
                # In steps: one store call never waits longer than a keep-alive interval.
                step = min(left, self.settings.keep_alive_interval)
                if self._news.watch(closed, 0, step).value is not None:
                    return True
            return self.is_closed()
        except StoreError as exc:
            raise RendezvousError(f"rendezvous of job {self._run_id!r}: {exc}") from None

    def num_nodes_waiting(self) -> int:
        if self._round is None:
            return 0
        return self._rounds.waiting(self._round)

    def note_restart(self, reason: str) -> None:
        self._restart_reason = reason
        self._spending = True

    def restarts_used(self, spent_here: int) -> int:
        """The job's count in the store (``relaunch/{run_id}/restarts``), which the node whose
        failure re-formed a round adds to; the last count read if the store cannot be read."""
        key = self._key("restarts")
        try:
            value = self._store.get(key).value
        except StoreError as exc:
            log.warning("could not read the job's restart count: %s", exc)
        else:
            self._restarts_seen = store_int(key, value)
        return self._restarts_seen

    def peers_alive(self, timeout: float) -> bool | None:
        """A roll call of the running round (``rollcall``): True when every member answered
        within ``timeout``."""
        round_, final = self._round, self._final
        if round_ is None or final is None:
            return None
        try:
            return roll_call(self._store, self._roster, self._key, round_, final.count, timeout)
        except StoreError as exc:
            log.warning("roll call of round %d: %s", round_, exc)
            return None

    def post_note(self, name: str, value: bytes) -> None:
        if self._round is None:
            return
        try:
            self._store.set(self._key(f"notes/{name}", self._round), value)
        except StoreError as exc:
            log.debug("could not post the note %r: %s", name, exc)

    def read_notes(self, names: Sequence[str]) -> dict[str, bytes]:
        round_, notes = self._round, dict[str, bytes]()
        if round_ is None:
            return notes
        try:
            if self._lease is not None and len(names) > 1:  # etcd: one range read for all
                prefix = self._key("notes/", round_)
                found, _ = cast("EtcdStore", self._store).read_prefix(prefix)
                wanted = set(names)
                for key, versioned in found.items():
                    name = key[len(prefix) :]
                    if name in wanted and versioned.value is not None:
                        notes[name] = versioned.value
                return notes
            for name in names:
                value = self._store.get(self._key(f"notes/{name}", round_)).value
                if value is not None:
                    notes[name] = value
        except StoreError as exc:
            log.debug("could not read the notes: %s", exc)
        return notes

    def stop_for_stacks(self, reason: str) -> None:
        """Mark the round re-formed now, asking its members for their workers' stacks, and count
        the group restart this node's hang spends (``_leave_round`` will find the record)."""
        if self._round is None or self._final is None or self._finished:
            return
        change = MembershipChange.restarting(reason, stacks=True)
        try:
            waiting = self.num_nodes_waiting()
            won = self._rounds.supersede(
                self._round, change, expected_size(self._final.count, change, waiting)
            )
            if won:
                self._store.add(self._key("restarts"), 1)
        except StoreError as exc:
            log.warning("could not ask the other nodes for their workers' stacks: %s", exc)

    def fail_job(self, reason: str, stacks: bool = False) -> None:
        """Mark the round failed (its members stop and report it, rather than re-form), then
        close the job."""
        if self._round is not None and self._final is not None and not self._finished:
            failed = MembershipChange.failed(reason, stacks)
            try:
                self._rounds.supersede(
                    self._round, failed, expected_size(self._final.count, failed)
                )
            except StoreConnectionError as exc:
                # The store is gone or out of reach (its host failed the job too, say): closing
                # the job there would wait for it up to join_timeout, for nobody. The other
                # nodes learn of this one from its silence.
                log.warning("could not tell the other nodes that the job failed: %s", exc)
                self._store_lost = self._finished = True
            except StoreError as exc:
                log.warning("could not tell the other nodes that the job failed: %s", exc)
        self.set_closed()

    def wait_membership_change(self, timeout: float) -> MembershipChange | None:
        self._changed.wait(timeout)
        return self.membership_change()

    def set_change_listener(self, listener: Callable[[], None] | None) -> None:
        with self._change_lock:
            self._listener = listener
            pending = self._change is not None
        if pending and listener is not None:
            _notify(listener)

    @property
    def lost_node_grace(self) -> float:
        # The neighbour's silence counts from its last beat seen, checked once a beat; an etcd
        # lease lasts whole seconds, and etcd looks for expired leases every half second or so.
        settings = self.settings
        if self._lease is not None:
            return math.ceil(settings.dead_after) + 1.0 + settings.keep_alive_interval
        return settings.dead_after + settings.keep_alive_interval

    def membership_change(self) -> MembershipChange | None:
        with self._change_lock:
            return self._change

    def exit_barrier(self, timeout: float) -> None:
        """Count this node done; group rank 0 waits for every member, then closes the job,
        which is what the others wait for. O(1) store operations a node, and no event that
        reaches every node but the one ``closed`` record. Ends early when a member is lost."""
        if self._round is None or self._final is None:
            return
        round_, members = self._round, self._final.count
        deadline = time.monotonic() + timeout
        interval = self.settings.keep_alive_interval
        try:
            self._roster.mark("done", round_)
            closed = self._key("closed")
            while not self._changed.is_set():  # a member was lost: the live ones are done
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("exit barrier: not every node finished within %s", seconds(timeout))
                    return
                if self._ticket == 1:
                    done = self._roster.await_tally("done", round_, members, min(left, interval))
                    if done >= members:
                        return
                elif self._news.watch(closed, 0, min(left, interval)).value is not None:
                    return
        except StoreConnectionError:
            self._finished = True  # the hosting node finished and left: everyone is done

    def set_closed(self) -> None:
        """Mark the job finished, so late nodes exit rather than wait. On etcd the job's keys
        go then: all but ``closed``, which lives on a lease of ``join_timeout`` seconds."""
        if self._finished:
            return
        self._finished = True
        round_ = self._round or 0
        try:
            if self._rounds.is_closed():
                return  # another node closed it (and cleaned up)
            if self._lease is not None:
                self._close_on_etcd(round_)
                return
            self._store.set(self._key("closed"), b"1")
            if self._round is not None and self._final is not None:
                finished = MembershipChange.finished()
                self._rounds.supersede(
                    self._round, finished, expected_size(self._final.count, finished)
                )
            # Wake and dismiss anyone waiting to join the next round.
            self._store.compare_set(self._key("final", round_ + 1), 0, CLOSED)
        except StoreError as exc:
            log.debug("could not mark the rendezvous closed: %s", exc)

    def _close_on_etcd(self, round_: int) -> None:
        """Delete the job's keys, then write ``closed`` on a lease: the members in the exit
        barrier wait for it, and nodes waiting to join the next round are dismissed."""
        store = cast("EtcdStore", self._store)
        store.delete_prefix(self._key(""))
        lease = store.grant_lease(self.settings.join_timeout)
        store.set(self._key("final", round_ + 1), CLOSED, lease=lease)
        store.set(self._key("closed"), b"1", lease=lease)

    def shutdown(self) -> bool:
        self._stop_watching()
        if self._feed is not None:
            self._feed.close()
        with self._change_lock:
            ended = self._change is not None and self._change.kind in (
                ChangeKind.FAILED,
                ChangeKind.FINISHED,
            )
        if (
            self._round is not None
            and self._final is not None
            and not self._finished
            and not self._store_lost
            and not ended  # the job is over: nobody re-forms, and its keys may be gone
        ):
            try:
                # Leaving before the job finished: the others re-form without this node. This
                # also wakes this node's own watcher, so its connection can close.
                left = MembershipChange.member_left(self._ticket - 1)
                self._rounds.supersede(self._round, left, expected_size(self._final.count, left))
            except StoreError:
                pass
        if self._lease is not None and not self._store_lost:
            self._lease.revoke()  # this node's heartbeat keys go at once
        for close in (self._hb_store.close, self._store.close, *self._on_shutdown):
            try:
                close()
            except Exception:  # shutting down: note it and go on
                log.debug("error while shutting down the rendezvous", exc_info=True)
        return True

    def _leave_round(self) -> None:
        """Before joining again: mark the current round as re-formed, so others follow. When
        this node's own failure re-forms it, the failure counts against the node, and may
        exclude it: the others then re-form without waiting for it."""
        self._stop_watching()
        if self._round is None or self._final is None or self._left:
            return
        self._left = True
        with self._change_lock:
            own = self._change is None
            change = self._change or MembershipChange.restarting(self._restart_reason)
            spending, self._spending = self._spending and own, False
            self._restart_reason = ""
            if self._change_recorded:
                return  # the round's record says it already: O(1) requests for the followers
        if self._rounds.is_closed():
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        waiting = self.num_nodes_waiting()
        others = self._final.count - 1 + waiting  # the next round, should this node be out
        read = self._read_record() if spending and self._exclusion is not None else None
        counted = None if read is None else self._counted(read[0], others)
        if (
            read is not None
            and counted is not None
            and counted.excluded_until > read[0].excluded_until
        ):
            until = time.strftime("%H:%M:%S", time.localtime(counted.excluded_until))
            change = MembershipChange.member_excluded(
                self._ticket - 1,
                f"node {self.identity} (group rank {self._ticket - 1}) is excluded until "
                f"{until}, having failed the job {read[0].failures + 1} times ({change.reason})",
            )
        won = self._rounds.supersede(
            self._round, change, expected_size(self._final.count, change, waiting)
        )
        if won and spending:  # one group restart, one unit, whoever else failed with it
            self._store.add(self._key("restarts"), 1)
            if read is not None and counted is not None:
                self._write_record(counted, read[1], others)

    def check_store(self) -> None:
        self._check_store_host()

    def _check_store_host(self) -> None:
        """After the store was lost: whether it still lives, judged as a member is, by the
        keep-alive detection time (``dead_after``) since the loss. ``StoreHostGone`` when its
        host refuses the connection all that time: on c10d the store lives in the agent that
        hosted it, and dies with it. A store that answers nothing at all (this node cut off, or
        the host down) is waited for as a rejoin waits, up to ``join_timeout``: said once."""
        lost_at, probe = self._store_lost_at, self._store_host_probe
        if lost_at is None or probe is None:
            return
        settings = self.settings
        left = lost_at + settings.dead_after - time.monotonic()
        try:
            probe(max(left, settings.keep_alive_interval))
        except StoreRefused as exc:
            self._store_lost = self._finished = True  # nothing more to write, nor wait for
            raise StoreHostGone(
                f"the rendezvous store's host is gone ({exc}): the node that hosted the store "
                "for job "
                f"{self._run_id!r} stopped or died, and a c10d store does not outlive its host; "
                "restart the job, or run it with --rdzv-backend etcd to survive the loss of "
                "any node"
            ) from None
        except StoreError as exc:
            if not self._store_unanswered_said:
                self._store_unanswered_said = True
                log.warning(
                    "the rendezvous store does not answer (%s): this node may be cut off from "
                    "its host, or the host may be down; trying to rejoin for up to %s "
                    "(join_timeout)",
                    exc,
                    seconds(settings.join_timeout),
                )
            return
        self._store_lost_at, self._store_unanswered_said = None, False  # it answers: a blip

    def _node_key(self) -> str:
        return self._key(f"nodes/{self.identity}")

    def _read_record(self) -> tuple[exclusion.NodeRecord, int]:
        key = self._node_key()
        stored = self._store.get(key)
        return store_record(key, stored.value), stored.version

    def _counted(self, record: exclusion.NodeRecord, others: int) -> exclusion.NodeRecord:
        """``record`` once one more failure of this node counts (``core.exclusion``)."""
        assert self._exclusion is not None
        return exclusion.after_failure(
            record, self._exclusion, time.time(), others, self.settings.min_nodes
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

    # -- watching the running round ---------------------------------------------------------------

    def _start_watching(self) -> None:
        round_ = self._round
        assert round_ is not None and self._final is not None
        self._watch = RoundWatch(
            lambda name: self._key(name, round_),
            self._ticket,
            self._final.count,
            self.settings,
            self._hb_store,
            self._watch_store,
            self._lease,
            lambda change, recorded: self._flag(round_, change, recorded),
            lambda: self._answers.mark("here", round_),
            feed=self._feed,
        )
        self._watch.start()

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _flag(self, round_: int, change: MembershipChange, recorded: bool) -> None:
        """Note ``change`` to round ``round_`` (the first one stands; ``recorded``: read from
        the round's ``changed`` record, so nobody needs to write it) and tell the listener; a
        late word about a round this node has already left is dropped."""
        with self._change_lock:
            if round_ != self._round:
                return
            if change.kind is ChangeKind.STORE_LOST and self._store_lost_at is None:
                self._store_lost_at = time.monotonic()
            first = self._change is None
            if first:
                self._change, self._change_recorded = change, recorded
            self._changed.set()
            listener = self._listener
        if first and listener is not None:
            _notify(listener)


def _notify(listener: Callable[[], None]) -> None:
    """Call a change listener; its failure must not stop the heartbeat that called it, nor go
    unheard (``runtime.report_failure``: the agent ends with one line)."""
    try:
        listener()
    except Exception as exc:
        report_failure("relaunch-heartbeat", exc)
