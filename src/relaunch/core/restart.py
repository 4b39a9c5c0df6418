"""The restart policy: what the agent does next, given how its worker group stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from relaunch.core.group import GroupState
from relaunch.core.membership import MembershipChange


class Action(str, enum.Enum):
    CONTINUE = "CONTINUE"  # keep watching
    SUCCEED = "SUCCEED"  # every worker finished: pass the exit barrier and return
    RESTART = "RESTART"  # stop the group, rendezvous again, start it again
    FAIL = "FAIL"  # no restarts left: report the failure


@dataclass(frozen=True)
class Decision:
    action: Action
    uses_restart: bool = False
    reason: str = ""


def decide(
    state: GroupState, restarts_left: int, membership_change: MembershipChange | None = None
) -> Decision:
    """A failure restarts the group while restarts remain. A membership change (nodes waiting to
    join, a node lost) restarts it without using one up, also when the workers failed because of
    it (a lost peer breaks their collectives)."""
    if state is GroupState.SUCCEEDED:
        return Decision(Action.SUCCEED)
    if membership_change is not None:
        return Decision(Action.RESTART, reason=membership_change.reason)
    if state is GroupState.FAILED:
        if restarts_left > 0:
            return Decision(Action.RESTART, uses_restart=True, reason="a worker failed")
        return Decision(Action.FAIL, reason="a worker failed and no restarts are left")
    return Decision(Action.CONTINUE)
