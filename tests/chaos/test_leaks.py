"""The leak detector that the tests, the chaos runs and the benchmarks share
(tests/support/procs.py): what carries a run's mark and outlives the grace is killed and named."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.procs import LeakCheck, collect_leaks, marked_pids, pid_alive

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_marked_process_that_outlives_the_grace_is_killed_and_named() -> None:
    check = LeakCheck()
    proc = subprocess.Popen(SLEEPER, env=check.process_env())
    try:
        # Right after a vfork'd exec the new image's environment may not be readable yet.
        deadline = time.monotonic() + 10
        while proc.pid not in marked_pids(check.mark):
            assert time.monotonic() < deadline, "the marked process is never seen"
            time.sleep(0.01)
        left = collect_leaks(check.mark, grace=0.2)
        assert len(left) == 1 and f"pid {proc.pid} " in left[0]
        assert proc.wait(timeout=10) < 0  # killed by a signal
        assert not pid_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_exits_within_the_grace_is_no_leak() -> None:
    check = LeakCheck()
    proc = subprocess.Popen([sys.executable, "-c", "pass"], env=check.process_env())
    try:
        assert collect_leaks(check.mark, grace=30.0) == []
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_other_marks_and_kept_pids_are_left_alone() -> None:
    ours, other = LeakCheck(), LeakCheck()
    proc = subprocess.Popen(SLEEPER, env=other.process_env())
    try:
        assert collect_leaks(ours.mark, grace=0.0) == []
        assert collect_leaks(other.mark, grace=0.0, keep={proc.pid}) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
