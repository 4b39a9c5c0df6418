"""The job-level services an agent uses beside torch's rendezvous handler methods.

``RendezvousHandler`` (``rendezvous.api``) keeps torch's methods: join a round, say the backend
and run id, close and shut down. What a job of several nodes shares beyond that (the restart
budget, the presence check, the job's failure, stack requests, notes, the exit barrier, exclusion
and the membership change, pushed to a listener as a typed value) is ``JobServices``. A handler
that offers them has a ``job`` attribute (the dynamic handler's is ``dynamic_job.DynamicJob``);
any other handler (static, or one written for torch) gets ``SoloJob``: a job of one node, with
fixed membership and nobody else to tell.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from relaunch.core.rendezvous.rounds import TICKET_SPAN

if TYPE_CHECKING:
    from relaunch.core.rendezvous.membership import MembershipChange
    from relaunch.core.sections import Learned
    from relaunch.rendezvous.api import RendezvousHandler

#: Called, from any thread, with each membership change (nodes waiting, a node lost, the job
#: failed or finished elsewhere).
ChangeListener = Callable[["MembershipChange"], None]


class JobServices(Protocol):
    """What every node of a job shares through the rendezvous store."""

    @property
    def watches_membership(self) -> bool:
        """Whether membership can change while workers run (if not, nothing needs watching)."""

    @property
    def pushes_changes(self) -> bool:
        """Whether each change reaches the listener; if not, ``membership_change`` is polled
        (every ``monitor_interval``) while membership is watched."""

    @property
    def lost_node_grace(self) -> float:
        """Seconds a lost node may take to be noticed (0: membership is fixed)."""

    def set_change_listener(self, listener: ChangeListener | None) -> None:
        """Call ``listener`` with the change to the running round, once a round (at once if
        one is already there); None removes it."""

    def membership_change(self) -> MembershipChange | None:
        """Why the running round should be re-formed, or None."""

    def leave_death_notice_with(self, send: Callable[[str | None], None]) -> None:
        """Have ``send`` hand this node's death notice (``death_notice``) to what outlives the
        agent (its orphan guardian), for every round it is a member of."""

    def share_learned(self, learned: Learned) -> Learned:
        """Merge the bounds this node's workers ``learned`` into the job's, and return the
        job's (``core.sections``): what the workers started next begin from."""

    def set_workers(self, role: str, local_world_size: int) -> None:
        """This node brings ``local_world_size`` workers of ``role`` to its next joins (the
        agent says it from its ``WorkerSpec`` before each join): nodes may differ in both."""

    def prepare_join(self) -> float | None:
        """Leave the running round before joining again; until when (``time.time()``) this
        node is excluded from the job, or None."""

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the job to finish; whether it has."""

    def check_store(self) -> None:
        """``StoreHostGone`` when the store was lost with its host; nothing otherwise."""

    def restarts_used(self, spent_here: int) -> int:
        """Group restarts the job has used (every node's), given those this node spent."""

    def note_restart(self, reason: str) -> None:
        """This node spends one of the job's restarts because of ``reason``: tell the others."""

    def leave_early(self) -> None:
        """Leave the running round now, as ``prepare_join`` would (the others re-form at once),
        while this node's failed workers are still being stopped; nothing when the store was
        lost (the join's checks come first), a warning when it cannot be reached."""

    def peers_alive(self, timeout: float) -> bool | None:
        """Whether every other member answers within ``timeout``; None: cannot tell."""

    def fail_job(self, reason: str, stacks: bool = False, requeue: bool = True) -> None:
        """End the job for every node (``stacks``: a worker hung; take stacks first;
        ``requeue`` False: restarting cannot help, and every node says so)."""

    def closing_failure(self) -> MembershipChange | None:
        """The failure that closed the job, if one did (read when the job closed while this
        node re-formed)."""

    def stop_for_stacks(self, reason: str) -> None:
        """A worker of this node hung: ask every other node for its workers' stacks."""

    def post_note(self, name: str, value: bytes) -> None:
        """Publish ``value`` as this round's note ``name`` for the other nodes."""

    def read_notes(self, names: Sequence[str]) -> dict[str, bytes]:
        """This round's notes of ``names`` that were posted."""

    @property
    def local_addr(self) -> str | None:
        """The address the other nodes reach this one at (None: a job of one node)."""

    @property
    def peer_key(self) -> str | None:
        """A key every node of the job can compute and nobody else can: derived from the job's
        token, never sent (None: the job has no token). The nodes' state copies prove it."""

    def gather(
        self, name: str, rank: int, count: int, value: bytes, timeout: float
    ) -> dict[int, bytes] | None:
        """Post ``value`` as group rank ``rank``'s part of this round's note ``name`` and wait
        up to ``timeout`` seconds for the parts of all ``count`` group ranks; None when they
        did not all come (a node was lost, the store failed)."""

    def exit_barrier(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until every live node's workers have finished."""

    @property
    def min_nodes(self) -> int:
        """The fewest nodes the job runs with (the minimum of ``--nnodes``)."""

    def spares(self) -> int:
        """Nodes waiting to join the running round: spares, when it is full."""

    def evict(self, node_rank: int, reason: str) -> None:
        """Evict the node of group rank ``node_rank`` as a straggler (``core.workers.eviction``):
        the round re-forms with a spare in its place, and that node, seeing it, stays out for
        the cooldown a failing node gets; ``reason`` is the line every node shows."""

    @property
    def evicted(self) -> str | None:
        """Why this node was evicted from the job (None: it was not)."""

    @property
    def exclusion_reason(self) -> str:
        """Why ``prepare_join`` last said this node is excluded: it failed the job too often,
        or it was evicted as a straggler."""


def check_workers(role: str, local_world_size: int) -> int:
    """``local_world_size``, once it and ``role`` are what a join can carry; ValueError in one
    line if not."""
    if not isinstance(role, str):
        raise ValueError(f"a worker role is a string, not {role!r}")
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int):
        raise ValueError(f"local_world_size must be a whole number, got {local_world_size!r}")
    if not 1 <= local_world_size < TICKET_SPAN:
        raise ValueError(f"local_world_size must be 1 to {TICKET_SPAN - 1}, got {local_world_size}")
    return local_world_size


def job_of(handler: RendezvousHandler) -> JobServices:
    """The job services of ``handler``: its own ``job``, or those of a job of one node."""
    job: JobServices | None = getattr(handler, "job", None)
    return job if job is not None else SoloJob(handler)


class SoloJob:
    """The job of a handler with no job services: one node, fixed membership, nobody to tell."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self._handler = handler

    watches_membership = False
    pushes_changes = False
    lost_node_grace = 0.0
    local_addr = None
    peer_key = None

    def set_change_listener(self, listener: ChangeListener | None) -> None:
        pass

    def membership_change(self) -> MembershipChange | None:
        return None

    def leave_death_notice_with(self, send: Callable[[str | None], None]) -> None:
        pass  # one node: nobody to tell

    def share_learned(self, learned: Learned) -> Learned:
        return learned  # one node: the agent keeps them

    def set_workers(self, role: str, local_world_size: int) -> None:
        pass  # nobody to tell: the agent places the workers (``agent.ranks``)

    def prepare_join(self) -> float | None:
        return None

    def wait_closed(self, timeout: float) -> bool:
        time.sleep(max(0.0, timeout))  # nothing closes the job but this node
        return self._handler.is_closed()

    def check_store(self) -> None:
        pass

    def restarts_used(self, spent_here: int) -> int:
        return spent_here

    def note_restart(self, reason: str) -> None:
        pass

    def leave_early(self) -> None:
        pass

    def peers_alive(self, timeout: float) -> bool | None:
        return None

    def fail_job(self, reason: str, stacks: bool = False, requeue: bool = True) -> None:
        pass

    def closing_failure(self) -> MembershipChange | None:
        return None

    def stop_for_stacks(self, reason: str) -> None:
        pass

    def post_note(self, name: str, value: bytes) -> None:
        pass

    def read_notes(self, names: Sequence[str]) -> dict[str, bytes]:
        return {}

    def gather(
        self, name: str, rank: int, count: int, value: bytes, timeout: float
    ) -> dict[int, bytes] | None:
        return {rank: value} if count == 1 else None

    def exit_barrier(self, timeout: float) -> None:
        pass

    min_nodes = 1
    evicted = None
    exclusion_reason = ""

    def spares(self) -> int:
        return 0  # one node: no spare

    def evict(self, node_rank: int, reason: str) -> None:
        pass  # one node: no spare to take its place
