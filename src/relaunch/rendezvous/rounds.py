"""The rounds of one job in the store: their keys and records, and how a node joins one.

The I/O that carries out ``core.rendezvous``'s decisions; the handler in ``dynamic`` drives it.
Keys, under ``relaunch/{run_id}/``::

    round                   the round nodes join now
    closed                  set once the job finished: late nodes exit cleanly
    r{n}/joins              join counter (ticket and workers so far, see core.rendezvous)
    r{n}/node/{ticket}      workers up to and including that node
    r{n}/final              the completed round: members, world size, master address
    r{n}/changed            set when the round must be re-formed: the change (kind, reason)
                            and the size of the next round (see core.membership)
    r{n}/hb/{ticket}        heartbeat of a member: a counter it bumps, or on etcd a key bound
                            to its lease, which etcd deletes when the member stops renewing it
    r{n}/done               members whose workers finished (the exit barrier)
"""

from __future__ import annotations

import json
import logging
import time

from relaunch.core import rendezvous as plan
from relaunch.core.membership import MembershipChange, decode_change, encode_change, expected_size
from relaunch.endpoints import find_free_port
from relaunch.rendezvous.api import RendezvousClosedError, RendezvousError
from relaunch.store.api import Store, StoreTimeout

log = logging.getLogger(__name__)

#: The final record of the round after the last one, once the job finished.
CLOSED = b"closed"


class Rounds:
    """The rounds of job ``run_id`` on ``store``, seen by a node at ``local_addr``."""

    def __init__(self, run_id: str, store: Store, settings: plan.Settings, local_addr: str) -> None:
        self._run_id = run_id
        self._store = store
        self.settings = settings
        self._local_addr = local_addr
        self._prefix = f"relaunch/{run_id}"

    def key(self, name: str, round_: int | None = None) -> str:
        """The store key ``name`` of the job, or of its round ``round_``."""
        if round_ is None:
            return f"{self._prefix}/{name}"
        return f"{self._prefix}/r{round_}/{name}"

    def is_closed(self) -> bool:
        """Whether the job finished (late nodes then exit rather than wait)."""
        return self._store.get(self.key("closed")).value is not None

    def join(self, local_world_size: int) -> tuple[int, int, int, plan.Final]:
        """Join the first open round, and the next ones while late: ``(round, ticket, workers
        through this node, final record)``."""
        started_at = time.monotonic()
        round_ = self._round_to_join()
        while True:
            total = self._store.add(
                self.key("joins", round_), plan.join_increment(local_world_size)
            )
            ticket, through = plan.unpack_join(total)
            self._store.set(self.key(f"node/{ticket}", round_), str(through).encode())
            final = self._await_round(round_, ticket, started_at)
            if final is not None:
                return round_, ticket, through, final
            self._announce_late(round_)
            round_ = self._advance_round(round_)

    def waiting(self, round_: int) -> int:
        """Nodes that joined the round after ``round_``."""
        return plan.unpack_join(self._get_int(self.key("joins", round_ + 1)))[0]

    def _get_int(self, key: str) -> int:
        value = self._store.get(key).value
        return int(value) if value else 0

    def _final_of(self, round_: int) -> plan.Final | None:
        value = self._store.get(self.key("final", round_)).value
        if value is None:
            return None
        if value == CLOSED:
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        data = json.loads(value)
        return plan.Final(
            data["count"], data["world_size"], data["master_addr"], data["master_port"]
        )

    def _round_to_join(self) -> int:
        """The first round that has not completed (or that this node was told to move to)."""
        if self.is_closed():
            raise RendezvousClosedError(f"the job {self._run_id!r} has already finished")
        round_ = self._get_int(self.key("round"))
        while self._final_of(round_) is not None:
            self._announce_late(round_)  # a no-op for rounds already re-formed
            round_ = self._advance_round(round_)
        return round_

    def _advance_round(self, round_: int) -> int:
        """Record that round ``round_ + 1`` is the one to join now; return it."""
        key = self.key("round")
        while True:
            current = self._store.get(key)
            if int(current.value or b"0") > round_:
                return round_ + 1
            if self._store.compare_set(key, current.version, str(round_ + 1).encode()).succeeded:
                return round_ + 1

    def _previous(self, round_: int) -> tuple[bool, int | None]:
        """Whether round ``round_ - 1`` still forms or runs, and how many nodes its re-forming
        expects. Until its members mark it re-formed, this round must not complete: a node
        that came too late for it would otherwise start a second world beside it."""
        if round_ == 0:
            return False, None
        changed = self._store.get(self.key("changed", round_ - 1)).value
        if changed is None:
            return True, None
        return False, decode_change(changed)[1]

    def _await_round(self, round_: int, ticket: int, started_at: float) -> plan.Final | None:
        """Wait for round ``round_`` to complete; its final record, or None if this node is late."""
        joins_key, final_key = self.key("joins", round_), self.key("final", round_)
        min_reached_at: float | None = None
        while True:
            final = self._final_of(round_)
            joined = plan.unpack_join(self._get_int(joins_key))[0]
            now = time.monotonic()
            if min_reached_at is None and joined >= self.settings.min_nodes:
                min_reached_at = now
            previous_running, expected = (False, None)
            if ticket == 1 and final is None:
                previous_running, expected = self._previous(round_)
            decision = plan.decide_join(
                self.settings,
                ticket,
                joined,
                final,
                started_at,
                min_reached_at,
                now,
                previous_running,
                expected,
            )
            if decision.step is plan.Step.MEMBER:
                return final
            if decision.step is plan.Step.LATE:
                return None
            if decision.step is plan.Step.FAIL:
                raise RendezvousError(
                    f"rendezvous of job {self._run_id!r} failed: {decision.reason}"
                )
            if decision.step is plan.Step.COMPLETE:
                self._complete(round_, decision.count)
                continue
            assert decision.deadline is not None
            # One wait per threshold, not one wake-up per join: O(1) operations for ticket 1 too.
            if ticket != 1:
                awaited = final_key
            elif previous_running:
                awaited = self.key("changed", round_ - 1)
            else:
                threshold = (
                    self.settings.min_nodes
                    if min_reached_at is None
                    else plan.completion_target(self.settings, expected)
                )
                awaited = self.key(f"node/{threshold}", round_)
            timeout = max(0.0, decision.deadline - time.monotonic())
            if ticket == 1:
                # Look at the join counter again now and then: a node that took a ticket but
                # died before registering never writes the key awaited here.
                timeout = min(timeout, self.settings.keep_alive_interval)
            try:
                self._store.wait([awaited], timeout)
            except StoreTimeout:
                pass  # a deadline passed: decide again

    def _complete(self, round_: int, count: int) -> None:
        """As the holder of ticket 1: write the final record of ``round_`` with ``count`` nodes.

        The last member's record gives the world size. A node that took a ticket but died
        before writing its record is left out (it is the last one here); one in the middle is
        caught by the heartbeats once the workers start.
        """
        for members in range(count, self.settings.min_nodes - 1, -1):
            last = self.key(f"node/{members}", round_)
            try:
                self._store.wait([last], self.settings.keep_alive_interval)
                break
            except StoreTimeout:
                log.warning(
                    "rendezvous: the node holding ticket %d joined but never "
                    "registered; completing the round without it",
                    members,
                )
        else:
            raise RendezvousError(
                f"rendezvous of job {self._run_id!r} failed: fewer than "
                f"{self.settings.min_nodes} joined nodes registered"
            )
        world_size = int(self._store.get(last).value or b"0")
        record = {
            "count": members,
            "world_size": world_size,
            "master_addr": self._local_addr,
            "master_port": find_free_port(self._local_addr),
        }
        self._store.compare_set(self.key("final", round_), 0, json.dumps(record).encode())

    def supersede(self, round_: int, change: MembershipChange, expected: int) -> None:
        """Mark ``round_`` for re-forming, the next round expecting ``expected`` nodes (the
        first change wins); its members see it at once."""
        self._store.compare_set(self.key("changed", round_), 0, encode_change(change, expected))

    def _announce_late(self, round_: int) -> None:
        """Having come too late for ``round_``: ask its members to make room, if there is any
        and none of them has finished yet (a finishing job is closed, not grown)."""
        final = self._final_of(round_)
        if final is None or final.count >= self.settings.max_nodes:
            return
        if self._get_int(self.key("done", round_)) == 0:
            waiting = MembershipChange.nodes_waiting(1)
            self.supersede(round_, waiting, expected_size(final.count, waiting, waiting=1))
