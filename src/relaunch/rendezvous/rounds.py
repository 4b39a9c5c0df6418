"""The rounds of one job in the store: their keys and records, and how a node joins one.

The I/O that carries out ``core.rendezvous.rounds``'s decisions; the handler in ``dynamic`` drives
it. Keys, under ``relaunch/{run_id}/``::

    round                   the round nodes join now: its lead writes it on completing it,
                            a node too late for it moves it on
    r{n}/...                who joined, per store (``roster``): a join counter on the built-in
                            store, one key per node on etcd
    r{n}/size               how many nodes the round wants (``min:max``), written by its lead
    r{n}/hb/{group rank}    heartbeat of a member: a counter it bumps, or on etcd a key bound
                            to its lease, which etcd deletes when the member stops renewing it
    r{n}/done               members whose workers finished (the exit barrier), a tally
    news/closed             set once the job finished: late nodes exit cleanly (on etcd the
                            job's other keys are deleted then, and this one lives on a lease);
                            the failure that ended the job, if one did (``closed_record``)
    news/r{n}/final         the completed round: members, world size, master address, when
                            it formed (``time.time()``, for ``relaunch status``), on
                            etcd the runs of create revisions that place the members, the
                            members' roles when they differ, and their group-rank order
                            when it is not their arrival order (``core.rendezvous.node_order``)
    news/r{n}/changed       set when the round must be re-formed: the change (kind, reason)
                            and the size of the next round (see core.rendezvous.membership)
    news/r{n}/bell          written with each change that stands, and by a presence check: what the
                            members block on (``presence``)

``news/`` holds what every node waits for, and only that: on etcd each node follows it with one
watch for its whole life (``store.etcd_feed``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import (
    ChangeKind,
    MembershipChange,
    decode_change,
    encode_change,
    expected_size,
)
from relaunch.core.rendezvous.node_order import Claim, decode_placing, encode_placing
from relaunch.core.rendezvous.rounds import Entry
from relaunch.endpoints import find_free_port
from relaunch.rendezvous.api import (
    BadStoreValue,
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
    store_change,
    store_int,
)
from relaunch.rendezvous.roster import Roster
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import StoreTimeout, Versioned, Watchable

if TYPE_CHECKING:
    from relaunch.rendezvous.kinds import StoreKind

log = logging.getLogger(__name__)

#: The final record of the round after the last one, once the job finished.
CLOSED = b"closed"
#: The ``closed`` record of a job that ended without a failure.
CLOSED_RECORD = b"1"
#: The keys every node waits for, kept under ``news/`` (``presence``'s ``call`` too).
NEWS = frozenset({"closed", "final", "changed", "bell", "call"})


def closed_record(failure: MembershipChange | None) -> bytes:
    """The ``closed`` record of a job ended by ``failure`` (a ``FAILED`` change), or by none.
    It outlives the rounds' records (on etcd the only key left): a node that re-forms when the
    job closes learns from it why, and whether the job may be run again."""
    return CLOSED_RECORD if failure is None else encode_change(failure, 0)


def closing_failure(record: bytes | None) -> MembershipChange | None:
    """The failure a ``closed`` record holds, if any; ``ValueError`` (saying what is wrong)
    for a record no relaunch wrote."""
    if record is None or record == CLOSED_RECORD:
        return None
    change = decode_change(record)[0]
    if change.kind is not ChangeKind.FAILED:
        raise ValueError(f"a {change.kind.value} change, where only a failure closes a job")
    return change


def news_prefix(run_id: str, round_: int | None = None) -> str:
    """Where the keys every node of job ``run_id`` waits for are: the job's, or those of round
    ``round_``."""
    return f"relaunch/{run_id}/news/" + ("" if round_ is None else f"r{round_}/")


def job_key(run_id: str, name: str, round_: int | None = None) -> str:
    """The store key ``name`` of job ``run_id``, or of its round ``round_``."""
    base = news_prefix(run_id) if name in NEWS else f"relaunch/{run_id}/"
    return f"{base}{name}" if round_ is None else f"{base}r{round_}/{name}"


class Rounds:
    """The rounds of job ``run_id`` on ``stores`` (their kind counts the joins, and serves the
    waits for a round's final record), seen by node ``node_id`` at ``local_addr``; deadlines
    are kept on ``clock``. A node that waits for others says so (``core.rendezvous.rounds.
    wait_line``, naming the store at ``where``) after ``RELAUNCH_WAIT_NOTICE`` seconds, then
    every ``NOTICE_REPEAT`` times that."""

    def __init__(
        self,
        run_id: str,
        stores: StoreKind,
        settings: plan.Settings,
        local_addr: str,
        node_id: str,
        clock: Clock = SYSTEM_CLOCK,
        where: str = "",
    ) -> None:
        self._run_id = run_id
        self._where = where
        self._notice_after, wrong = plan.notice_after(os.environ.get("RELAUNCH_WAIT_NOTICE"))
        if wrong is not None:
            log.warning("%s", wrong)
        self._notice_at = 0.0  # when a node still waiting says so next (``join``)
        self._stores = stores
        self._store = stores.store
        self._news: Watchable = stores.news
        self.settings = settings
        self._local_addr = self.local_addr = local_addr
        self._clock = clock
        self.roster: Roster = stores.roster(self.key, node_id)
        self._next_round = 0  # where this node tries to join first
        self._spare_of: int | None = None  # the full round this node said it stands by

    def key(self, name: str, round_: int | None = None) -> str:
        """The store key ``name`` of the job, or of its round ``round_``."""
        return job_key(self._run_id, name, round_)

    def news_prefix(self, round_: int | None = None) -> str:
        """Where the keys every node waits for are: the job's, or those of round ``round_``."""
        return news_prefix(self._run_id, round_)

    def is_closed(self) -> bool:
        """Whether the job finished (late nodes then exit rather than wait)."""
        return self._store.get(self.key("closed")).value is not None

    def join(
        self,
        local_world_size: int,
        role: str,
        last: tuple[int, int] | None = None,
        node_rank: int | None = None,
    ) -> tuple[int, int, int, plan.Final]:
        """Join the first open round with ``local_world_size`` workers of ``role``, and the next
        ones while late: ``(round, ticket, workers through this node, final record)``. A member
        starts from the round after its last. ``last`` (``(round, group rank)`` where this
        node was a member last) and ``node_rank`` (its place in the scheduler's order) ask for
        a group rank (``core.rendezvous.node_order``)."""
        started_at = self._clock.monotonic()
        self._notice_at = started_at + self._notice_after
        round_ = self._next_round
        while True:
            claim = Claim(last, node_rank, self._local_addr, find_free_port(self._local_addr))
            joined = self.roster.join(round_, local_world_size, role, claim)
            if joined.closed:
                raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
            if joined.entry is None:  # the round completed without this node
                if joined.round_now > round_:
                    round_ = joined.round_now
                    continue
                self._announce_late(round_)
                round_ = self._advance_round(round_)
                continue
            entry = joined.entry
            if entry.lead:  # how many nodes the round wants, for ``relaunch status``
                self._store.set(self.key("size", round_), plan.encode_size(self.settings))
            final = self._await_round(round_, entry, started_at)
            placed = None if final is None else self.roster.place(entry, final)
            if final is not None and placed is not None:
                self._next_round = round_ + 1
                return round_, placed[0], placed[1], final
            self._announce_late(round_)
            round_ = self._advance_round(round_)

    def waiting(self, round_: int | None) -> int:
        """Nodes that joined the round after ``round_`` (none before this node's first)."""
        return 0 if round_ is None else self.roster.joined(round_ + 1)

    def _final_of(self, round_: int) -> plan.Final | None:
        return self._parse_final(self._store.get(self.key("final", round_)), round_)

    def _parse_final(self, record: Versioned, round_: int) -> plan.Final | None:
        value = record.value
        if value is None:
            return None
        if value == CLOSED:
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        try:
            data = json.loads(value)
            count, world_size = _count(data["count"]), _count(data["world_size"])
            final = plan.Final(
                count,
                world_size,
                str(data["master_addr"]),
                _count(data["master_port"]),
                tuple((_count(a), _count(b), _count(c)) for a, b, c in data.get("runs", ())),
                record.version,
                tuple((_role(a), _count(b), _count(c)) for a, b, c in data.get("roles", ())),
                decode_placing(data, count, world_size),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            why = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise BadStoreValue(self.key("final", round_), value, why) from None
        if not 0 < final.count <= final.world_size or not 0 < final.master_port < 65536:
            raise BadStoreValue(self.key("final", round_), value, "counts out of range")
        return final

    def _advance_round(self, round_: int) -> int:
        """Record that round ``round_ + 1`` is the one to join now; return it."""
        key = self.key("round")
        while True:
            current = self._store.get(key)
            if store_int(key, current.value) > round_:
                return round_ + 1
            if self._store.compare_set(key, current.version, str(round_ + 1).encode()).succeeded:
                return round_ + 1

    def _previous(self, round_: int) -> tuple[bool, int | None]:
        """Whether round ``round_ - 1`` still forms or runs, and how many nodes its re-forming
        expects. Until its members mark it re-formed, this round must not complete: a node
        that came too late for it would otherwise start a second world beside it."""
        if round_ == 0:
            return False, None
        changed_key = self.key("changed", round_ - 1)
        changed = self._store.get(changed_key).value
        if changed is None:
            if self._store.get(self.key("final", round_ - 1)).value != CLOSED:
                return True, None
        else:
            change, expected = store_change(changed_key, changed)
            if change.kind not in (ChangeKind.FINISHED, ChangeKind.FAILED):
                return False, expected
        # The job ended (a spare behind spares sees the round before dismissed): dismiss the
        # nodes waiting in this round too, before the closing node gets to it.
        self._store.compare_set(self.key("final", round_), 0, CLOSED)
        raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")

    def _await_round(self, round_: int, entry: Entry, started_at: float) -> plan.Final | None:
        """Wait for round ``round_`` to complete; its final record, or None if this node is late.

        Only the lead reads the joins (and whether the round before still runs); the others
        just wait for the final record, which the join saw absent.
        """
        settings = self.settings
        min_reached_at: float | None = None
        final: plan.Final | None = None
        spare = False  # waiting behind a running round: join_timeout counts from its end
        while True:
            now = self._clock.monotonic()
            joined = 0
            previous_running, expected = (False, None)
            due = now >= started_at + settings.join_timeout
            if entry.lead or due:
                final = self._final_of(round_)
                if final is None:  # count the joins (also to say how many, on giving up)
                    joined = self.roster.joined(round_)
            if min_reached_at is None and joined >= settings.min_nodes:
                min_reached_at = now
            if (entry.lead or due) and final is None:
                previous_running, expected = self._previous(round_)
                if spare and not previous_running:
                    started_at = now  # the round it stood by re-forms: the join starts now
                spare = previous_running
            decision = plan.decide_join(
                settings,
                entry.ticket,
                joined,
                final,
                started_at,
                min_reached_at,
                now,
                previous_running,
                expected,
                member=final is not None and self.roster.place(entry, final) is not None,
            )
            if decision.step is plan.Step.MEMBER:
                return final
            if decision.step is plan.Step.LATE:
                return None
            if decision.step is plan.Step.FAIL:
                raise RendezvousTimeoutError(
                    f"rendezvous of job {self._run_id!r} failed: {decision.reason}"
                )
            if decision.step is plan.Step.COMPLETE:
                self._complete(round_, decision.count)
                continue
            assert decision.deadline is not None
            if now >= self._notice_at:
                self._say_waiting(round_, entry.lead, joined, min_reached_at, started_at, spare)
                self._notice_at = now + self._notice_after * plan.NOTICE_REPEAT
            deadline = min(decision.deadline, self._notice_at)
            # One wait per threshold, not one wake-up per join: O(1) operations for the lead too.
            if not entry.lead:
                final = self._await_final(round_, deadline)
                continue
            self._await_joins(round_, deadline, previous_running, min_reached_at, expected)

    def _say_waiting(
        self,
        round_: int,
        lead: bool,
        joined: int,
        min_reached_at: float | None,
        started_at: float,
        spare: bool,
    ) -> None:
        """Say what this node waits for in round ``round_`` (``core.rendezvous.rounds.
        wait_line``). The lead read the joins and the round before already; another node reads
        them now (a few reads a minute)."""
        settings = self.settings
        if not lead:
            joined = self.roster.joined(round_)
            spare = self._previous(round_)[0]
        running = None
        if spare:
            before = self._final_of(round_ - 1)
            running = settings.max_nodes if before is None else before.count
        last_call_at = None
        if lead and min_reached_at is not None:
            last_call_at = min_reached_at + settings.last_call_timeout
        waiting = plan.Waiting(joined, last_call_at, running)
        now = self._clock.monotonic()
        give_up_at = started_at + settings.join_timeout
        log.warning(
            "%s", plan.wait_line(settings, waiting, self._run_id, self._where, now, give_up_at)
        )

    def _await_final(self, round_: int, deadline: float) -> plan.Final | None:
        """As a node that is not the lead: wait until ``deadline`` for the final record."""
        timeout = max(0.0, deadline - self._clock.monotonic())
        return self._parse_final(self._news.watch(self.key("final", round_), 0, timeout), round_)

    def _await_joins(
        self,
        round_: int,
        deadline: float,
        previous_running: bool,
        min_reached_at: float | None,
        expected: int | None,
    ) -> None:
        """As the lead: wait until ``deadline`` for the round before to re-form (while it runs),
        or for the joins to reach the next threshold."""
        settings = self.settings
        # Look at the joins again now and then: on the built-in store, a node that took a
        # ticket but died before registering never writes the key awaited here.
        timeout = min(max(0.0, deadline - self._clock.monotonic()), settings.keep_alive_interval)
        if previous_running:
            try:
                self._store.wait([self.key("changed", round_ - 1)], timeout)
            except StoreTimeout:
                pass
            return
        threshold = (
            settings.min_nodes
            if min_reached_at is None
            else plan.completion_target(settings, expected)
        )
        self.roster.await_joined(round_, threshold, timeout)

    def _complete(self, round_: int, count: int) -> None:
        """As the lead: write the final record of ``round_`` with (up to) ``count`` nodes."""
        try:
            members = self.roster.members(round_, count, self.settings)
        except RendezvousError as exc:
            raise RendezvousError(f"rendezvous of job {self._run_id!r} failed: {exc}") from None
        # The workers' master is on the member of group rank 0: this node, or the one whose
        # join record said where.
        master_addr, master_port = members.master or (
            self._local_addr,
            find_free_port(self._local_addr),
        )
        record: dict[str, object] = {
            "count": members.nodes,
            "world_size": members.world_size,
            "master_addr": master_addr,
            "master_port": master_port,
            "at": round(self._clock.time(), 3),  # when it formed, for ``relaunch status``
        }
        if members.runs:
            record["runs"] = members.runs
        if members.roles:
            record["roles"] = members.roles
        if members.placing is not None:
            record.update(encode_placing(members.placing))
        if self._store.compare_set(
            self.key("final", round_), 0, json.dumps(record).encode()
        ).succeeded:
            # Where nodes that come now start (members move on by themselves).
            self._store.set(self.key("round"), str(round_).encode())

    def supersede(self, round_: int, change: MembershipChange, expected: int) -> bool:
        """Mark ``round_`` for re-forming, the next round expecting ``expected`` nodes; its
        members see it at once. The first change wins: whether it was this one."""
        # Members block on the round signal (``presence``), which a presence check writes too.
        return self._stores.supersede(
            self.key("changed", round_), self.key("bell", round_), encode_change(change, expected)
        )

    def _announce_late(self, round_: int) -> None:
        """Having come too late for ``round_``: ask its members to make room, if there is any
        and none of them has finished yet (a finishing job is closed, not grown). A full round
        gets a spare: it says so, once a round. A round already re-forming (a member was lost,
        say) is neither asked nor called full: the next round has this node's place."""
        final = self._final_of(round_)
        if final is None or self._store.get(self.key("changed", round_)).value is not None:
            return  # no round to make room in, or one that re-forms already: the next has room
        if final.count >= self.settings.max_nodes:
            if self._spare_of != round_:
                self._spare_of = round_
                log.warning(
                    "job %r is full (%d of at most %d nodes): waiting as a spare, to take the "
                    "place of a node that is lost",
                    self._run_id,
                    final.count,
                    self.settings.max_nodes,
                )
            return
        if self.roster.tally("done", round_) == 0:
            waiting = MembershipChange.nodes_waiting(1)
            self.supersede(round_, waiting, expected_size(final.count, waiting, waiting=1))


def _count(value: object) -> int:
    """A whole number of a record relaunch wrote: ``ValueError`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r:.40} is not a count")
    return value


def _role(value: object) -> str | None:
    """A role of a record relaunch wrote (None: not known): ``ValueError`` for anything else."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{value!r:.40} is not a role")
    return value
