"""The restart policy: what the agent does next, given how its worker group stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from relaunch.core.group import GroupState


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


def decide(state: GroupState, restarts_left: int, nodes_waiting: int) -> Decision:
    """A failure restarts the group while restarts remain; a node waiting to join restarts it
    without using one up (a membership change is not a failure)."""
    if state is GroupState.SUCCEEDED:
        return Decision(Action.SUCCEED)
    if state is GroupState.FAILED:
        if restarts_left > 0:
            return Decision(Action.RESTART, uses_restart=True, reason="a worker failed")
        return Decision(Action.FAIL, reason="a worker failed and no restarts are left")
    if nodes_waiting > 0:
        return Decision(Action.RESTART, reason=f"{nodes_waiting} node(s) waiting to join")
    return Decision(Action.CONTINUE)
