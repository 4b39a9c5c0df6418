"""torchft's replica groups under ``relaunch --replica-groups`` (issue 46): on one node, a
worker of one group SIGKILLed mid-run; the other groups keep stepping and never restart, the
failed group restarts on its own and heals from a live group, and every group ends with the
same weights. The real library (torchft 0.2.0, CPU, gloo, the test install's), and the
training program of ``python -m benchmarks replicas``."""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys

import pytest
from conftest import LeakCheck, relaunch_cli

from tests.support.ft_lines import Line, parse

PROGRAM = str(pathlib.Path(__file__).parents[2] / "benchmarks" / "workers" / "torchft_train.py")
STEPS, KILL_STEP, FAILED = 30, 10, 1


@functools.cache
def has_replica_groups() -> bool:
    """Whether this relaunch has ``--replica-groups`` (issue 46 item 2)."""
    shown = subprocess.run(
        [sys.executable, "-m", "relaunch", "--help"], capture_output=True, text=True, timeout=30
    )
    return "--replica-groups" in shown.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("groups", [2, 3])
def test_a_failed_group_heals_while_the_others_go_on(leaks: LeakCheck, groups: int) -> None:
    if not has_replica_groups():
        pytest.skip("this relaunch has no --replica-groups yet (issue 46 item 2)")
    done = relaunch_cli(
        leaks,
        *("--replica-groups", str(groups), "--nproc-per-node", "1", "--max-restarts", "2"),
        PROGRAM,
        *("--steps", str(STEPS), "--pace", "0.02"),
        *("--kill-group", str(FAILED), "--kill-step", str(KILL_STEP)),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = parse(done.stdout)  # torchft's logs go to stderr

    def of(kind: str, group: int) -> list[Line]:
        return [line for line in lines if line.kind == kind and line.group == group]

    (kill,) = [line for line in lines if line.kind == "kill"]
    assert (kill.group, kill.step) == (FAILED, KILL_STEP)
    for group in range(groups):
        starts = of("start", group)
        steps = [line.step for line in of("step", group)]
        if group == FAILED:
            # Restarted once, alone; its first step after the kill continues from a live
            # group's state (healed), not from step 1.
            assert [s.fields["attempt"] for s in starts] == ["0", "1"]
            back = [line.step for line in of("step", group) if line.at > kill.at]
            assert back and back[0] > KILL_STEP, steps
        else:
            # Never stopped or restarted, stepping on after the kill in order.
            assert [s.fields["attempt"] for s in starts] == ["0"]
            assert steps == sorted(steps) and steps[-1] >= STEPS
            assert any(line.at > kill.at for line in of("step", group))
    finals = {group: of("done", group) for group in range(groups)}
    assert all(len(final) == 1 and final[0].step >= STEPS for final in finals.values()), finals
    # Every group ends at the same step, with the same weights.
    ends = {(final[0].step, final[0].fields["sha256"]) for final in finals.values()}
    assert len(ends) == 1, finals
