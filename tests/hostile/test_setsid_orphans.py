"""A daemon that a worker double-forks into a session of its own (fork, setsid, fork, the middle
process exits) leaves the worker's process group: stopping the group no longer reaches it. It
must still be gone within a second of the end of its group, on every way a job ends: the
workers' normal end, a failure and group restart, SIGTERM of relaunch, SIGKILL of relaunch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck, pid_alive, wait_until

pytestmark = pytest.mark.timeout(60)

RELAUNCH = [sys.executable, "-m", "relaunch"]
#: The promise is one second; the deadline leaves room for a loaded CI machine.
GONE_WITHIN = 3.0

#: argv: PID_DIR MODE. The worker double-forks a setsid daemon that writes its pid to
#: PID_DIR/daemon.ATTEMPT and sleeps; once it is up, the worker exits 0 (``exit``), fails in
#: attempt 0 and in attempt 1 writes whether attempt 0's daemon is still alive (``fail``), or
#: says it is ready and sleeps (``run``).
WORKER = textwrap.dedent(
    """
    import os, sys, time

    pid_dir, mode = sys.argv[1], sys.argv[2]
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]

    def write(name, text):
        path = os.path.join(pid_dir, name)
        with open(path + ".tmp", "w") as file:
            file.write(text)
        os.rename(path + ".tmp", path)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as file:
                return file.read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except OSError:
            return False

    if attempt == "1":  # attempt 0's daemon must be gone before attempt 1 starts
        with open(os.path.join(pid_dir, "daemon.0")) as file:
            write("seen", "alive" if alive(int(file.read())) else "gone")
        sys.exit(0)
    up_r, up_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            write(f"daemon.{attempt}", str(os.getpid()))
            os.write(up_w, b"x")
            time.sleep(300)
        os._exit(0)
    os.close(up_w)
    os.waitpid(middle, 0)
    assert os.read(up_r, 1) == b"x"
    if mode == "fail":
        sys.exit(1)
    if mode == "run":
        write("ready", "")
        time.sleep(300)
    """
)


def start(tmp_path, leaks: LeakCheck, mode: str, *flags: str) -> tuple[subprocess.Popen[str], str]:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job = tmp_path / "daemonizing.py"
    job.write_text(WORKER)
    launcher = subprocess.Popen(
        [*RELAUNCH, "--nproc-per-node", "1", *flags, str(job), str(pid_dir), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )
    return launcher, str(pid_dir)


def daemon_pid(pid_dir: str, attempt: int = 0) -> int:
    with open(os.path.join(pid_dir, f"daemon.{attempt}")) as file:
        return int(file.read())


def assert_gone(pid: int, how: str) -> None:
    wait_until(
        lambda: not pid_alive(pid),
        timeout=GONE_WITHIN,
        what=f"the setsid daemon (pid {pid}) to be gone after {how}",
    )


def test_a_setsid_daemon_dies_with_the_normal_end_of_the_job(tmp_path, leaks: LeakCheck) -> None:
    launcher, pid_dir = start(tmp_path, leaks, "exit")
    _, stderr = launcher.communicate(timeout=50)
    assert launcher.returncode == 0, stderr
    assert_gone(daemon_pid(pid_dir), "the workers' normal end")


def test_a_setsid_daemon_dies_with_its_group_before_the_restart(tmp_path, leaks) -> None:
    launcher, pid_dir = start(tmp_path, leaks, "fail", "--max-restarts", "1")
    _, stderr = launcher.communicate(timeout=50)
    assert launcher.returncode == 0, stderr
    with open(os.path.join(pid_dir, "seen")) as file:
        assert file.read() == "gone", "attempt 0's daemon outlived its group into attempt 1"
    assert_gone(daemon_pid(pid_dir), "the restart")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_setsid_daemon_dies_with_the_launcher(tmp_path, leaks: LeakCheck, sig: int) -> None:
    launcher, pid_dir = start(tmp_path, leaks, "run")
    wait_until(
        lambda: os.path.exists(os.path.join(pid_dir, "ready")) or launcher.poll() is not None,
        timeout=30,
        what="the worker and its daemon to start",
    )
    assert launcher.poll() is None, launcher.communicate()[1]
    daemon = daemon_pid(pid_dir)
    assert pid_alive(daemon)
    launcher.send_signal(sig)
    launcher.communicate(timeout=50)
    assert launcher.returncode in (128 + sig, -sig)
    assert_gone(daemon, f"relaunch's {signal.Signals(sig).name}")


def test_closing_a_group_kills_its_daemons_and_nothing_else(tmp_path, leaks: LeakCheck) -> None:
    """From the API, in this process: a bystander in a session of its own (as the guardian, the
    forkserver or a user's server are) outlives the group's close; the group's daemon does not."""
    import relaunch

    log_dir, pid_dir = tmp_path / "logs", tmp_path / "pids"
    log_dir.mkdir()
    pid_dir.mkdir()
    job = tmp_path / "daemonizing.py"
    job.write_text(WORKER)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env=leaks.process_env(),
        start_new_session=True,
    )
    try:
        context = relaunch.start_processes(
            "w",
            sys.executable,
            {0: (str(job), str(pid_dir), "exit")},
            {0: {**leaks.env, "TORCHELASTIC_RESTART_COUNT": "0"}},
            str(log_dir),
        )
        result = context.wait(30)
        assert result is not None and not result.is_failed()
        daemon = daemon_pid(str(pid_dir))
        assert pid_alive(daemon), "the daemon outlives its worker until the group is closed"
        context.close()
        assert not pid_alive(daemon), "close() returns once the daemon is gone"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
