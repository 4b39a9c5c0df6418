"""The order of a stop (``core.run.stop_plan``), for each situation."""

from __future__ import annotations

import pytest

from relaunch.core.run.stop_plan import Feature, StopPhase, stop_plan

P = StopPhase
ALWAYS = (P.STOP_POSTS, P.WAIT_FOR_STACKS, P.CLOSE, P.RECORD_OUTCOME, P.FINAL_BAR)
EVERY = frozenset(Feature)

CASES = [
    # running, park, features, phases
    (False, False, EVERY, (P.STOP_POSTS,)),
    (False, True, frozenset(), (P.STOP_POSTS,)),
    (True, False, frozenset(), ALWAYS),
    (True, True, frozenset(), ALWAYS),
    (
        True,
        False,
        {Feature.KEPT_STATE},
        (
            P.STOP_POSTS,
            P.SAVE_JUST_IN_TIME,
            P.WAIT_FOR_STACKS,
            P.CLOSE,
            P.HOLD_COPIES,
            P.RECORD_OUTCOME,
            P.FINAL_BAR,
        ),
    ),
    (
        True,
        False,
        {Feature.PARKING},
        (P.STOP_POSTS, P.WAIT_FOR_STACKS, P.CLOSE, P.KEEP_PARKED, P.RECORD_OUTCOME, P.FINAL_BAR),
    ),
    (
        True,
        True,
        {Feature.PARKING},
        (
            P.STOP_POSTS,
            P.WAIT_FOR_STACKS,
            P.WAIT_FOR_PARKS,
            P.CLOSE,
            P.KEEP_PARKED,
            P.RECORD_OUTCOME,
            P.FINAL_BAR,
        ),
    ),
    (
        True,
        False,
        {Feature.ZYGOTE},
        (P.STOP_POSTS, P.WAIT_FOR_STACKS, P.CLOSE, P.REVIVE_ZYGOTE, P.RECORD_OUTCOME, P.FINAL_BAR),
    ),
    (
        True,
        True,
        EVERY,
        (
            P.STOP_POSTS,
            P.SAVE_JUST_IN_TIME,
            P.WAIT_FOR_STACKS,
            P.WAIT_FOR_PARKS,
            P.CLOSE,
            P.KEEP_PARKED,
            P.STOP_TORCH_STORE,
            P.HOLD_COPIES,
            P.REVIVE_ZYGOTE,
            P.RECORD_OUTCOME,
            P.FINAL_BAR,
        ),
    ),
    (
        True,
        False,
        EVERY,
        (
            P.STOP_POSTS,
            P.SAVE_JUST_IN_TIME,
            P.WAIT_FOR_STACKS,
            P.CLOSE,
            P.KEEP_PARKED,
            P.STOP_TORCH_STORE,
            P.HOLD_COPIES,
            P.REVIVE_ZYGOTE,
            P.RECORD_OUTCOME,
            P.FINAL_BAR,
        ),
    ),
]


@pytest.mark.parametrize(("running", "park", "features", "phases"), CASES)
def test_the_phases_of_a_stop(
    running: bool, park: bool, features: frozenset[Feature], phases: tuple[StopPhase, ...]
) -> None:
    assert stop_plan(running=running, park=park, features=features) == phases
