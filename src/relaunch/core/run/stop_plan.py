"""The order in which an attempt's workers are stopped (``StopWorkers``), as data: the agent's
driver (``agent.workers.Workers.stop``) runs the phases this returns, each by the feature that
owns it (``agent.hooks``).

Pure: the situation in, the ordered phases out.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum


class Feature(Enum):
    """An agent feature that adds phases to a stop."""

    KEPT_STATE = "kept state"  # --state: the workers' save_state, and its just-in-time save
    PARKING = "parking"  # restart in place: ranks that park are kept for the next attempt
    TORCH_STORE = "torch store"  # the agent of group rank 0 serves torch's store
    ZYGOTE = "zygote"  # --preload: the process each Python worker is forked from


class StopPhase(Enum):
    """One step of stopping an attempt's workers."""

    STOP_POSTS = "stop the status posts"
    SAVE_JUST_IN_TIME = "tell the running workers, and wait for their saves"
    WAIT_FOR_STACKS = "let ranks asked for their stacks write them"
    WAIT_FOR_PARKS = "let the ranks that restart in place park"
    CLOSE = "signal the workers, SIGKILL after the shutdown timeout"
    KEEP_PARKED = "keep the parked ranks for the next attempt"
    STOP_TORCH_STORE = "stop serving torch's store"
    HOLD_COPIES = "hold the state's copies to other nodes"
    REVIVE_ZYGOTE = "start the zygote again if it died"
    RECORD_OUTCOME = "record how the attempt ended, and its last progress"
    FINAL_BAR = "print the node bar's final state"


def stop_plan(*, running: bool, park: bool, features: Collection[Feature]) -> tuple[StopPhase, ...]:
    """The phases of a stop, in order: ``running`` (an attempt was started), ``park`` (the stop
    is for a failure that broke the group's collectives: ranks may park), ``features`` (those
    this agent runs with)."""
    if not running:
        return (StopPhase.STOP_POSTS,)
    wanted = {
        StopPhase.SAVE_JUST_IN_TIME: Feature.KEPT_STATE in features,
        StopPhase.WAIT_FOR_PARKS: park and Feature.PARKING in features,
        StopPhase.KEEP_PARKED: Feature.PARKING in features,
        StopPhase.STOP_TORCH_STORE: Feature.TORCH_STORE in features,
        StopPhase.HOLD_COPIES: Feature.KEPT_STATE in features,
        StopPhase.REVIVE_ZYGOTE: Feature.ZYGOTE in features,
    }
    return tuple(phase for phase in StopPhase if wanted.get(phase, True))
