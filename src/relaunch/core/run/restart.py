"""The restart policy: what the agent does next, given how its worker group stands, and how
long it waits before a restart of a crash loop (``Backoff``, ``CrashLoop``)."""

from __future__ import annotations

import enum

from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange
from relaunch.core.run.group import GroupStatus
from relaunch.core.value import Value


class Action(str, enum.Enum):
    CONTINUE = "CONTINUE"  # keep watching
    SUCCEED = "SUCCEED"  # every worker finished: pass the exit barrier and return
    RESTART = "RESTART"  # stop the group, rendezvous again, start it again
    FAIL = "FAIL"  # no restarts left (here, or on the node that ended the job): report it
    AWAIT_CHANGE = "AWAIT_CHANGE"  # failed: until ``deadline``, wait for a membership change


class RestartDecision(Value):
    """What to do next; ``deadline`` (AWAIT_CHANGE) is on the clock ``decide`` was given."""

    __slots__ = ("action", "cause", "deadline", "reason", "requeue", "stacks", "uses_restart")

    action: Action
    uses_restart: bool
    reason: str
    deadline: float | None
    #: Another node's worker hung: take this node's workers' stacks before stopping them.
    stacks: bool
    #: Why, as a word for counting: ``worker_failed``, ``hang`` (a worker hung on some node),
    #: or the kind of the membership change (``member_lost``, ``nodes_waiting``, ...).
    cause: str
    #: FAIL: whether running the job again could help (False: another node stopped it for a
    #: failure that restarting cannot mend).
    requeue: bool

    def __init__(
        self,
        action: Action,
        uses_restart: bool = False,
        reason: str = "",
        deadline: float | None = None,
        stacks: bool = False,
        cause: str = "",
        requeue: bool = True,
    ) -> None:
        self._set(
            action=action,
            uses_restart=uses_restart,
            reason=reason,
            deadline=deadline,
            stacks=stacks,
            cause=cause,
            requeue=requeue,
        )


def decide(
    state: GroupStatus,
    restarts_left: int,
    membership_change: MembershipChange | None = None,
    *,
    lost_node_grace: float = 0.0,
    now: float = 0.0,
    grace_ends: float | None = None,
    peers_alive: bool | None = None,
) -> RestartDecision:
    """A failure restarts the group while restarts remain (``restarts_left``: the job's, shared
    by every node). A membership change (nodes waiting to join, a node lost) restarts it without
    using one up, also when the workers failed because of it (a lost peer breaks their
    collectives); a change saying the job failed or finished elsewhere ends this node too (its
    workers are cut short: a failure).

    Collectives break at once when a peer node dies; heartbeats tell it a moment later. So a failure
    with no restarts left is final at once only when every other node answered a presence check
    (``peers_alive``); otherwise not before ``lost_node_grace`` seconds (from ``now``, or until
    ``grace_ends`` once a previous decision set it) have passed without a change: then the lost node
    is noticed, and the restart is free.
    """
    if state is GroupStatus.SUCCEEDED:
        return RestartDecision(Action.SUCCEED)
    if membership_change is not None:
        stacks = membership_change.stacks
        cause = "hang" if stacks else membership_change.kind.value
        action = (
            Action.FAIL
            if membership_change.kind in (ChangeKind.FAILED, ChangeKind.FINISHED)
            else Action.RESTART
        )
        return RestartDecision(
            action,
            reason=membership_change.reason,
            stacks=stacks,
            cause=cause,
            requeue=membership_change.requeue,
        )
    if state is GroupStatus.FAILED:
        if restarts_left > 0:
            return RestartDecision(
                Action.RESTART, uses_restart=True, reason="a worker failed", cause="worker_failed"
            )
        if peers_alive:
            return RestartDecision(
                Action.FAIL,
                reason="a worker failed, no restarts are left and every other node is alive",
            )
        ends = now + lost_node_grace if grace_ends is None else grace_ends
        if now < ends:
            return RestartDecision(
                Action.AWAIT_CHANGE,
                reason="a worker failed: waiting for a lost node to be noticed",
                deadline=ends,
            )
        return RestartDecision(Action.FAIL, reason="a worker failed and no restarts are left")
    return RestartDecision(Action.CONTINUE)


#: The causes of a restart that break the workers' collectives (a peer died, or stopped): ranks
#: that restart in place wait in them rather than exit. A hang, nodes waiting to join or a
#: lost store break nothing: those workers are stopped.
BREAKS_COLLECTIVES = frozenset(
    {
        "worker_failed",
        "restarting",
        "member_lost",
        "member_left",
        "member_excluded",
        "member_evicted",
    }
)


# -- crash loops ------------------------------------------------------------------------------


class Backoff(Value):
    """Waits between the restarts of a crash loop: none before the first restart, ``base``
    seconds before the second in a row, doubling up to ``cap``. A group that ran ``healthy``
    seconds before it failed is not part of a loop: the count starts again."""

    __slots__ = ("base", "cap", "healthy")

    base: float
    cap: float
    healthy: float

    def __init__(self, base: float = 1.0, cap: float = 30.0, healthy: float = 60.0) -> None:
        self._set(base=base, cap=cap, healthy=healthy)
        if self.base < 0 or self.cap < self.base or self.healthy <= 0:
            raise ValueError(
                f"a backoff needs 0 <= base <= cap and healthy > 0, got {self.base}, "
                f"{self.cap}, {self.healthy}"
            )

    def delay(self, in_a_row: int) -> float:
        """Seconds to wait before restart number ``in_a_row`` of a loop (1: the first)."""
        if in_a_row <= 1 or self.base == 0:
            return 0.0
        return min(self.cap, self.base * 2.0 ** (in_a_row - 2))


class Mark(Value):
    """How far an attempt got, as its workers said: the highest step any local rank reported
    (None: none reported), and the sections and heartbeats they completed."""

    __slots__ = ("signs", "step")

    step: int | None
    signs: int

    def __init__(self, step: int | None = None, signs: int = 0) -> None:
        self._set(step=step, signs=signs)


class CrashLoop(Value):
    """The restarts in a row: ``in_a_row`` failures of groups that ran less than the backoff's
    healthy period, ``stalled`` of them in a row without progress, and ``best_step``, the
    highest step any earlier attempt reached; ``failure``, the last failure's signature
    (``core.run.failures.failure_signature``), and ``repeated``, the attempts in a row that ended
    with it, none of them getting further than the ones before (an attempt that did starts
    the count again: a job that fails the same way after hours of progress may be unlucky)."""

    __slots__ = ("best_step", "failure", "in_a_row", "repeated", "stalled")

    in_a_row: int
    stalled: int
    best_step: int | None
    failure: str
    repeated: int

    def __init__(
        self,
        in_a_row: int = 0,
        stalled: int = 0,
        best_step: int | None = None,
        failure: str = "",
        repeated: int = 0,
    ) -> None:
        self._set(
            in_a_row=in_a_row,
            stalled=stalled,
            best_step=best_step,
            failure=failure,
            repeated=repeated,
        )

    def after_failure(
        self, ran_for: float, mark: Mark, backoff: Backoff, failure: str = ""
    ) -> CrashLoop:
        """The loop after an attempt that ran ``ran_for`` seconds and got to ``mark`` failed
        with ``failure`` (its signature)."""
        in_a_row = 1 if ran_for >= backoff.healthy else self.in_a_row + 1
        progressed = made_progress(self.best_step, mark)
        stalled = self.stalled + 1 if progressed is False else 0
        best = self.best_step
        if mark.step is not None:
            best = mark.step if best is None else max(best, mark.step)
        same = failure and failure == self.failure and progressed is not True
        repeated = self.repeated + 1 if same else 1
        return CrashLoop(in_a_row, stalled, best, failure, repeated)


def made_progress(best_step: int | None, mark: Mark) -> bool | None:
    """Whether an attempt got further than every earlier one: a step above ``best_step``, or,
    from workers that report no steps, a completed section or a heartbeat. None when its
    workers said nothing at all (there is nothing to judge by)."""
    if mark.step is not None:
        return best_step is None or mark.step > best_step
    if best_step is not None:
        return False  # the workers report steps, and none came this time
    return True if mark.signs > 0 else None


def may_stall_out(loop: CrashLoop, limit: int) -> bool:
    """Whether the next failure could stop the job (``stalled_out``), whatever it turns out to
    be: with no progress and the same failure again, each count is one higher."""
    return limit > 0 and (loop.stalled + 1 >= limit or loop.repeated + 1 > limit)


def stalled_out(loop: CrashLoop, limit: int) -> str | None:
    """Why restarting cannot help, so the job stops and is not to be requeued: ``limit``
    restarts in a row made no progress, or ``limit`` attempts in a row failed the same way
    (0: never); None while it may."""
    if limit <= 0:
        return None
    if loop.stalled >= limit:
        where = "" if loop.best_step is None else f" (the furthest step reached: {loop.best_step})"
        return (
            f"stopped after {loop.stalled} restarts in a row that made no progress{where}: "
            "restarting again would repeat the same failure"
        )
    if loop.repeated > limit:  # the first failure, then ``limit`` restarts that repeated it
        return (
            f"stopped after {loop.repeated} attempts in a row failed the same way: "
            "restarting again would repeat it"
        )
    return None


def startup_failure(rank_spoke: bool, workers_speak: bool) -> bool:
    """Whether a worker's failure came during start-up: before its first progress report,
    heartbeat or section, in a job whose workers use them (``workers_speak``: some rank did, in
    this attempt or an earlier one). Of workers that never use them nothing can be told: a
    quick job's crash after its last step would look like one at its start."""
    return workers_speak and not rank_spoke
