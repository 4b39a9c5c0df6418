"""What the relaunch command tells a person about failures, run as a real process."""

from __future__ import annotations

import re
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


HUNG = """
    import time
    print("started", flush=True)
    time.sleep(300)  # no output, progress or timer activity: hung
"""


def test_a_hangs_line_says_what_follows_it_a_restart_or_the_runs_end(
    tmp_path, leaks: LeakCheck
) -> None:
    done = relaunch(
        leaks,
        "--nproc-per-node",
        "1",
        "--hang-timeout",
        "1",
        "--max-restarts",
        "1",
        script(tmp_path, HUNG),
    )
    assert done.returncode == 1, done.stderr
    hangs = [line for line in done.stderr.splitlines() if "shows no sign of life" in line]
    assert len(hangs) == 2, done.stderr
    assert hangs[0].endswith("sending SIGABRT for its stack, then restarting the worker group")
    assert hangs[1].endswith("sending SIGABRT for its stack, then ending the run (no restart left)")


FAILS_ONCE = """
    import os, sys, time
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        sys.exit(3)
    time.sleep(0.5)
"""


def test_workers_that_report_no_steps_get_no_goodput_line(tmp_path, leaks: LeakCheck) -> None:
    """Without steps there is no telling what share of the run trained."""
    done = relaunch(
        leaks, "--nproc-per-node", "1", "--max-restarts", "1", script(tmp_path, FAILS_ONCE)
    )
    assert done.returncode == 0, done.stderr
    assert "succeeded" in done.stderr and "  restart 1: " in done.stderr
    assert "goodput" not in done.stderr


HANGS_AT_STEP_5 = """
    import os, time, relaunch
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for step in range(10):
        relaunch.report_progress(step, 10)
        if attempt == 0 and step == 5:
            time.sleep(300)  # hung after its progress report of step 5
        time.sleep(0.05)
"""


def test_a_hangs_time_from_its_last_progress_is_counted_as_lost(tmp_path, leaks: LeakCheck) -> None:
    """The hang began at the last progress, a hang timeout (1 s) before the SIGABRT that
    ended it: detection counts that second, and the share trained leaves it out."""
    done = relaunch(
        leaks,
        "--nproc-per-node",
        "1",
        "--hang-timeout",
        "1",
        "--max-restarts",
        "1",
        script(tmp_path, HANGS_AT_STEP_5),
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "goodput:" in line]
    found = re.search(r"goodput: ([\d.]+)% of ([\d.]+)s trained; ([\d.]+)s lost", line)
    assert found is not None, line
    share, elapsed, lost = map(float, found.groups())
    detection = re.search(r"detection ([\d.]+)s", line)
    assert detection is not None and float(detection.group(1)) >= 1.0, line
    assert lost >= 1.0 and share <= 100 * (elapsed - 1.0) / elapsed + 0.1, line


RAISES = """
    def main():
        raise ValueError("the data is missing")
    main()
"""


def test_a_lone_worker_with_its_stderr_on_the_console_is_pointed_at_above(
    tmp_path, leaks: LeakCheck
) -> None:
    """Its traceback is on the console above the report, not in a log: the report says so,
    and the summary points at no log directory, which holds nothing."""
    job = script(tmp_path, RAISES)
    done = relaunch(leaks, "--nproc-per-node", "1", job)
    assert done.returncode == 1
    err = done.stderr
    assert err.index("ValueError: the data is missing") < err.index("Root cause"), err
    said = "    its stderr went to the console, not to a log: its traceback, if it printed one"
    assert said + ", is above" in err
    assert "no error file and no stderr log" not in err
    assert "  logs: " not in err, err
    logged = relaunch(
        leaks, "--nproc-per-node", "1", "-r", "2", "--log-dir", str(tmp_path / "logs"), job
    )
    assert "last lines of stderr" in logged.stderr and "is above" not in logged.stderr
    assert f"  logs: {tmp_path / 'logs'}" in logged.stderr, logged.stderr


def test_a_failure_has_one_header_on_a_restart_and_at_the_end(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "import sys\nsys.exit(3)\n")
    done = relaunch(leaks, "--nproc-per-node", "1", "--max-restarts", "1", job)
    assert done.returncode == 1
    headers = [line for line in done.stderr.splitlines() if " failed: 1 worker failed" in line]
    assert headers == ["relaunch: job.py failed: 1 worker failed"] * 2, done.stderr


API_USER = """
    import sys
    from relaunch.launcher import LaunchConfig, elastic_launch

    def train():
        raise ValueError("the data is missing")

    def main():
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=1, rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0", max_restarts=0, log_dir=sys.argv[1],
        )
        elastic_launch(config, train)()

    if __name__ == "__main__":
        main()
"""


def test_a_failed_elastic_launch_shows_the_users_frames_not_relaunchs(
    tmp_path, leaks: LeakCheck
) -> None:
    """A script that calls ``elastic_launch(config, fn)()``: the worker's traceback, the
    root cause's in the message and the ChildFailedError's own all show the user's frames;
    of relaunch's, only the line that raised it at the API's edge."""
    done = subprocess.run(
        [sys.executable, script(tmp_path, API_USER), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=50,
    )
    assert done.returncode == 1
    err = done.stderr
    frames = [line.strip() for line in err.splitlines() if line.strip().startswith("File ")]
    ours = [frame for frame in frames if "/relaunch/" in frame]
    assert len(ours) == 1 and "launcher.py" in ours[0] and "__call__" in ours[0], err
    assert "multiprocessing" not in err, err
    assert "ChildFailedError: train failed: 1 worker failed" in err
    report = err[err.index("Root cause (first failure):") :]
    assert "ValueError: the data is missing" in report, err
    first = next(line for line in report.splitlines() if "File " in line)
    assert 'job.py", line 6, in train' in first, err
