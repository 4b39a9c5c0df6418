"""The restart policy: what the agent does next, given how its worker group stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from relaunch.core.group import GroupState
from relaunch.core.membership import ChangeKind, MembershipChange


class Action(str, enum.Enum):
    CONTINUE = "CONTINUE"  # keep watching
    SUCCEED = "SUCCEED"  # every worker finished: pass the exit barrier and return
    RESTART = "RESTART"  # stop the group, rendezvous again, start it again
    FAIL = "FAIL"  # no restarts left (here, or on the node that ended the job): report it
    AWAIT_CHANGE = "AWAIT_CHANGE"  # failed: until ``deadline``, wait for a membership change


@dataclass(frozen=True)
class RestartDecision:
    """What to do next; ``deadline`` (AWAIT_CHANGE) is on the clock ``decide`` was given."""

    action: Action
    uses_restart: bool = False
    reason: str = ""
    deadline: float | None = None


def decide(
    state: GroupState,
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

    Collectives break at once when a peer node dies; heartbeats tell it a moment later. So a
    failure with no restarts left is final at once only when every other node answered a roll
    call (``peers_alive``); otherwise not before ``lost_node_grace`` seconds (from ``now``, or
    until ``grace_ends`` once a previous decision set it) have passed without a change: then
    the lost node is noticed, and the restart is free.
    """
    if state is GroupState.SUCCEEDED:
        return RestartDecision(Action.SUCCEED)
    if membership_change is not None:
        if membership_change.kind in (ChangeKind.FAILED, ChangeKind.FINISHED):
            return RestartDecision(Action.FAIL, reason=membership_change.reason)
        return RestartDecision(Action.RESTART, reason=membership_change.reason)
    if state is GroupState.FAILED:
        if restarts_left > 0:
            return RestartDecision(Action.RESTART, uses_restart=True, reason="a worker failed")
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
