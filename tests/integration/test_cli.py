"""The relaunch command, run as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck, pid_alive, wait_until

pytestmark = pytest.mark.timeout(60)


def relaunch(
    leaks: LeakCheck, *argv: str, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv], capture_output=True, text=True,
        env=leaks.process_env(), cwd=cwd, timeout=50,
    )  # fmt: skip


def script(tmp_path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_runs_n_workers_with_their_ranks(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, """
        import os, sys
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], sys.argv[1:])
    """)  # fmt: skip
    done = relaunch(leaks, "--nproc-per-node", "3", "--tee", "3", job, "--lr", "0.1")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[default{r}]:rank {r} of 3 ['--lr', '0.1']" for r in range(3)
    ]


def test_underscore_spellings_and_log_dir(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "print('logged')\n")
    logs = tmp_path / "logs"
    done = relaunch(leaks, "--nproc_per_node", "2", "--log_dir", str(logs), "-r", "1", job)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    (run_dir,) = logs.iterdir()
    assert (run_dir / "1" / "stdout.log").read_text() == "logged\n"


def test_failure_prints_the_report_and_exits_1(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, """
        import os, time
        if os.environ["RANK"] == "1":
            raise RuntimeError("the data is missing")
        time.sleep(300)
    """)  # fmt: skip
    done = relaunch(leaks, "--nproc-per-node", "2", "--redirects", "2", job)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == "job.py failed: 1 worker failed, 1 stopped because of it"
    assert "RuntimeError: the data is missing" in done.stderr
    assert lines[-1] == "Stopped because of the failure (not failures): rank 0"
    assert "relaunch/cli.py" not in done.stderr, "no traceback of the launcher's own"


def test_module_and_no_python(tmp_path, leaks: LeakCheck) -> None:
    script(tmp_path, "print('as a module')\n", name="mymod.py")
    done = relaunch(leaks, "-m", "-t", "1", "mymod", cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[default0]:as a module\n"
    done = relaunch(leaks, "--no-python", "--tee", "1", "echo", "plain", "binary")
    assert done.stdout == "[default0]:plain binary\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "banana", "x.py"], "--nproc-per-node"),
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node"),
        (["--tee", "9", "x.py"], "-t/--tee"),
        (["missing_script.py"], "training script 'missing_script.py' does not exist"),
        (["--no-python", "no-such-binary-xyz"], "'no-such-binary-xyz' was not found on PATH"),
        (["-m", "--no-python", "x"], "--module and --no-python cannot be used together"),
        ([], "the following arguments are required"),
        (["--shutdown-timeout", "-1", "x.py"], "--shutdown-timeout"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    leaks: LeakCheck, argv: list[str], message: str
) -> None:
    done = relaunch(leaks, *argv)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_help_groups_the_flags(leaks: LeakCheck) -> None:
    done = relaunch(leaks, "--help")
    assert done.returncode == 0
    for heading in ("workers:", "logs:", "--nproc-per-node", "--tee", "(default: 1)"):
        assert heading in done.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_workers_and_exits_128_plus_signal(
    tmp_path, leaks: LeakCheck, sig: signal.Signals
) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job = script(tmp_path, f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        open(os.path.join({str(pid_dir)!r}, f"{{os.getpid()}}.{{child.pid}}"), "w").close()
        time.sleep(300)
    """)  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", job],
        env=leaks.process_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(lambda: len(os.listdir(pid_dir)) == 2, what="the workers to start")
    pids = [int(p) for name in os.listdir(pid_dir) for p in name.split(".")]
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig
    assert f"stopped by {sig.name}" in stderr
    assert not any(pid_alive(pid) for pid in pids)


def test_a_worker_ignoring_sigterm_is_killed_after_the_shutdown_timeout(
    tmp_path, leaks: LeakCheck
) -> None:
    ready = tmp_path / "ready"
    job = script(tmp_path, f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(300)
    """)  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--shutdown-timeout", "0.5", job],
        env=leaks.process_env(), stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_until(ready.exists, what="the worker to start")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
