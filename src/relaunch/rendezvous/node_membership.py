"""Where one node stands in its job: the round it is a member of, the first change to that round
(and who is told of it), and whether the job is over for this node.

The dynamic handler (``dynamic``) and its job services (``dynamic_job``) share one
``NodeMembership``: the handler moves it into each round it joins, the round's watching threads
(``heartbeat``) flag changes to it, and the job services act on the running round.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange
from relaunch.core.workers.ranks import DEFAULT_ROLE
from relaunch.runtime import SYSTEM_CLOCK, Clock, report_failure

if TYPE_CHECKING:
    from relaunch.rendezvous.heartbeat import RoundWatch
    from relaunch.rendezvous.job import ChangeListener


class NodeMembership:
    """One node's place in its job (``round`` None: before its first round). The change, the
    listener and the move to a new round are guarded by one lock; the rest is the node's own."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self.round: int | None = None
        self.group_rank = 0
        self.final: plan.Final | None = None
        self._change: MembershipChange | None = None
        self._recorded = False  # whether ``_change`` came from the round's record
        self._lock = threading.Lock()  # guards _change, _listener, and round's update
        self._changed = threading.Event()
        self._listener: ChangeListener | None = None
        self.watch: RoundWatch | None = None
        # Set once the job is over for this node (closed, or its store gone with the node that
        # hosted it): from then on nothing more is written, and nothing waits to reconnect.
        self.finished = False
        # Set once the store could not be reached within the deadlines: shutting down then
        # writes nothing (it would only wait for the store again).
        self.store_lost = False
        # When a watching thread lost the store (``clock.monotonic()``): its host is judged
        # from then on (``dynamic_job``).
        self.store_lost_at: float | None = None
        # This node left its round (``prepare_join``).
        self.left = False
        # Whether this node's next re-form is its own restart after a failure, which spends
        # one of the job's restarts if its change is the one that stands; and why.
        self.spending = False
        self.restart_reason = ""
        # What this node brings to its next join: (role, workers), as its agent said
        # (``DynamicJob.set_workers``).
        self.workers: tuple[str, int] = (DEFAULT_ROLE, 1)

    def enter(self, round_: int, group_rank: int, final: plan.Final) -> None:
        """This node is a member of round ``round_`` now, of group rank ``group_rank``."""
        with self._lock:
            self.round, self.group_rank, self.final = round_, group_rank, final
            self._change, self._recorded = None, False
            self._changed.clear()
            self.left = False

    @property
    def change(self) -> MembershipChange | None:
        """The change to the running round, or None."""
        with self._lock:
            return self._change

    @property
    def ended(self) -> bool:
        """Whether the change to the running round ends the job (it failed, or finished)."""
        change = self.change
        return change is not None and change.kind in (ChangeKind.FAILED, ChangeKind.FINISHED)

    def wait_change(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a change to the running round; whether one came."""
        return self._changed.wait(timeout)

    def changed(self) -> bool:
        """Whether a change to the running round came."""
        return self._changed.is_set()

    def leave(self) -> tuple[MembershipChange, bool, bool]:
        """Leaving the running round: the change it is left with (the one that came, or this
        node's restart), whether this node spends a restart on it, and whether the round's
        record says it already."""
        with self._lock:
            own = self._change is None
            change = self._change or MembershipChange.restarting(self.restart_reason)
            spending, self.spending = self.spending and own, False
            self.restart_reason = ""
            return change, spending, self._recorded

    def flag(self, round_: int, change: MembershipChange, recorded: bool) -> None:
        """Note ``change`` to round ``round_`` (the first one stands; ``recorded``: read from
        the round's ``changed`` record, so nobody needs to write it) and tell the listener; a
        late word about a round this node has already left is dropped."""
        with self._lock:
            if round_ != self.round:
                return
            if change.kind is ChangeKind.STORE_LOST and self.store_lost_at is None:
                self.store_lost_at = self._clock.monotonic()
            first = self._change is None
            if first:
                self._change, self._recorded = change, recorded
            self._changed.set()
            listener = self._listener
        if first and listener is not None:
            _notify(listener, change)

    def set_listener(self, listener: ChangeListener | None) -> None:
        """Call ``listener`` with the change to each round (at once if one came); None removes
        it."""
        with self._lock:
            self._listener = listener
            pending = self._change
        if pending is not None and listener is not None:
            _notify(listener, pending)

    def stop_watching(self) -> None:
        """Stop the running round's watch, if any."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None


def _notify(listener: ChangeListener, change: MembershipChange) -> None:
    """Call a change listener; its failure must not stop the heartbeat that called it, nor go
    unheard (``runtime.report_failure``: the agent ends with one line)."""
    try:
        listener(change)
    except Exception as exc:
        report_failure("relaunch-heartbeat", exc)
