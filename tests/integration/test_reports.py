"""What the relaunch command tells a person about failures, run as a real process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck

pytestmark = pytest.mark.timeout(60)


def relaunch(leaks: LeakCheck, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=50,
    )


def script(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


KILLED = """
    import os, sys, time
    if os.environ["LOCAL_RANK"] == "0":
        print("about to be killed", file=sys.stderr, flush=True)
        os.kill(os.getpid(), 9)
    time.sleep(300)
"""


def test_a_worker_killed_by_sigkill_is_explained_not_told_to_use_record(
    tmp_path, leaks: LeakCheck
) -> None:
    done = relaunch(leaks, "--nproc-per-node", "2", script(tmp_path, KILLED))
    assert done.returncode == 1
    assert "killed by SIGKILL (signal 9)" in done.stderr
    assert "    SIGKILL: killed from outside, most often by the out-of-memory killer" in done.stderr
    assert "@relaunch.record" not in done.stderr and "-r 2" not in done.stderr
    assert "Rank 1 did not fail: relaunch stopped it because of the failure above" in done.stderr
    assert "not failures" not in done.stderr


def test_with_a_stderr_log_the_meaning_comes_before_the_last_lines(
    tmp_path, leaks: LeakCheck
) -> None:
    done = relaunch(leaks, "--nproc-per-node", "2", "-r", "2", script(tmp_path, KILLED))
    lines = done.stderr.splitlines()
    meaning = next(i for i, line in enumerate(lines) if line.startswith("    SIGKILL: "))
    assert lines[meaning + 1].startswith("    last lines of stderr (")
    assert lines[meaning + 2] == "    about to be killed"


def test_a_restart_line_ends_with_no_empty_heading(tmp_path, leaks: LeakCheck) -> None:
    job = script(
        tmp_path,
        """
        import sys
        print("ValueError: the data is missing", file=sys.stderr)
        sys.exit(3)
    """,
    )
    done = relaunch(leaks, "--nproc-per-node", "1", "--tee", "3", "--max-restarts", "1", job)
    assert done.returncode == 1
    restarts = [line for line in done.stderr.splitlines() if line.startswith("  restart 1: ")]
    assert restarts, done.stderr
    assert not restarts[0].rstrip().endswith(":"), restarts[0]
    assert restarts[0].startswith("  restart 1: rank 0 exited with code 3")


def test_after_a_rendezvous_failure_the_workers_never_started(tmp_path, leaks: LeakCheck) -> None:
    from relaunch.endpoints import find_free_port

    port = find_free_port("127.0.0.1")
    done = relaunch(
        leaks,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "join_timeout=1",
        script(tmp_path, "pass\n"),
    )
    assert done.returncode == 1
    assert "rendezvous" in done.stderr
    assert "  2 workers never started (local ranks 0, 1)" in done.stderr
    assert "rank -1" not in done.stderr and "did not end" not in done.stderr
