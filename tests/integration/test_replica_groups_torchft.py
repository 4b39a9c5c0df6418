"""torchft's replica groups under ``relaunch --replica-groups`` (issue 46): on one node, a
worker of one group SIGKILLed mid-run; the other groups keep stepping and never restart, the
failed group restarts on its own and heals from a live group, and every group ends with the
same weights. torchft's lighthouse SIGKILLed mid-run: relaunch starts it again behind the
workers' address, its quorum ids past the last one, and every group trains on to the end, none
restarted. The real library (torchft 0.2.0, CPU,
gloo, the test install's), and the training program of ``python -m benchmarks replicas``."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import LeakCheck, relaunch_cli, wait_until

from tests.support.ft_lines import Line, parse

PROGRAM = str(pathlib.Path(__file__).parents[2] / "benchmarks" / "workers" / "torchft_train.py")
STEPS, KILL_STEP, FAILED = 30, 10, 1


#: torchft's tests keep both cores busy: they run one after another, in one xdist group of
#: their own (beside the torch group: one group of both made the suite 11 min).
pytestmark = [pytest.mark.xdist_group("torchft")]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("groups", [2, 3])
def test_a_failed_group_heals_while_the_others_go_on(leaks: LeakCheck, groups: int) -> None:
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
    # It died at its first step at or past KILL_STEP: a group that heals into a quorum ahead of
    # it skips steps (one run went 9, 11 on a loaded machine).
    assert kill.group == FAILED and kill.step >= KILL_STEP
    before = [line.step for line in of("step", FAILED) if line.at <= kill.at]
    assert before[-1] == kill.step and all(step < KILL_STEP for step in before[:-1]), before
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


#: The supervisor's line that names the lighthouse it keeps.
LIGHTHOUSE_RE = re.compile(r"torchft's lighthouse for the \d+ groups: (\S+) \(pid (\d+),")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_lighthouse_killed_mid_run_is_restarted_and_training_goes_on(
    leaks: LeakCheck, tmp_path: pathlib.Path
) -> None:
    # Three groups: a restarted lighthouse that numbered its quorums from 1 again sent torchft to
    # a store prefix an earlier quorum of that id used, and every group crashed (1 run in 4)
    groups, steps = 3, 40
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "relaunch", "--replica-groups", str(groups)),
                *("--nproc-per-node", "1", "--max-restarts", "1"),
                *(PROGRAM, "--steps", str(steps), "--pace", "0.02"),
            ],
            stdout=stdout,
            stderr=stderr,
            env=leaks.process_env(),
        )
    try:
        found: list[re.Match[str]] = []

        def stepping() -> bool:
            if not found:
                found.extend(filter(None, [LIGHTHOUSE_RE.search(err.read_text())]))
            return bool(found) and any(
                line.kind == "step" and line.step >= 10 for line in parse(out.read_text())
            )

        wait_until(stepping, timeout=90, what="the groups at step 10, the lighthouse named")
        address, pid = found[0].group(1), int(found[0].group(2))
        os.kill(pid, signal.SIGKILL)  # the supervisor's child: it reaps it
        killed_at = time.time()
        assert proc.wait(timeout=120) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = err.read_text()
    killed = f"torchft's lighthouse (pid {pid}) killed by SIGKILL (signal 9); restarting it at once"
    assert killed in said
    back_on = f"torchft's lighthouse is back on {address} after "
    back = re.search(re.escape(back_on) + r"\S+, its quorum ids past (\d+)", said)
    assert back is not None and int(back.group(1)) >= 1, said[-3000:]
    assert "Gloo" not in said
    # started without --preload: told once how a failed group would restart warm
    assert said.count("--preload torch,torch._dynamo,torchft restarts them warm") == 1
    lines = parse(out.read_text())
    for group in range(groups):
        # Stepping on after the kill, never restarted.
        starts = [line for line in lines if line.kind == "start" and line.group == group]
        assert [s.fields["attempt"] for s in starts] == ["0"], starts
        after = [line for line in lines if line.kind == "step" and line.group == group]
        assert any(line.at > killed_at for line in after)
    finals = [line for line in lines if line.kind == "done"]
    assert len(finals) == groups and all(line.step >= steps for line in finals), finals
    assert len({(line.step, line.fields["sha256"]) for line in finals}) == 1, finals
