"""The launcher's own death and signals: workers and their descendants never outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import LeakCheck, pid_alive, wait_until

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.timeout(60)


def start_launcher(tmp_path, leaks: LeakCheck, kind: str) -> tuple[subprocess.Popen[str], str]:
    log_dir, pid_dir = tmp_path / "logs", tmp_path / "pids"
    log_dir.mkdir()
    pid_dir.mkdir()
    env = leaks.process_env(PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launcher = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "launcher.py"), str(log_dir), str(pid_dir), kind],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert launcher.stdout is not None
    assert launcher.stdout.readline() == "ready\n"
    return launcher, str(pid_dir)


def tree_pids(pid_dir: str) -> list[int]:
    return [int(pid) for name in os.listdir(pid_dir) for pid in name.split(".")]


@pytest.mark.parametrize("kind", ["binary", "function"])
def test_sigkill_of_the_launcher_leaves_no_orphans(tmp_path, leaks: LeakCheck, kind: str) -> None:
    launcher, pid_dir = start_launcher(tmp_path, leaks, kind)
    pids = tree_pids(pid_dir)
    assert len(pids) == 4 and all(pid_alive(pid) for pid in pids)
    launcher.kill()
    launcher.wait()
    wait_until(
        lambda: not any(pid_alive(pid) for pid in pids),
        timeout=1.0,
        what="workers and grandchildren to die within 1 s of the launcher's SIGKILL",
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_to_the_launcher_stops_the_workers_and_exits_128_plus_signal(
    tmp_path, leaks: LeakCheck, sig: signal.Signals
) -> None:
    launcher, pid_dir = start_launcher(tmp_path, leaks, "binary")
    pids = tree_pids(pid_dir)
    launcher.send_signal(sig)
    assert launcher.wait() == 128 + sig
    assert not any(pid_alive(pid) for pid in pids), "workers are gone before the launcher exits"


def test_the_processes_a_test_starts_get_sigint_and_sigquit_at_their_default(
    leaks: LeakCheck,
) -> None:
    """The precondition of the signal tests here and of ``relaunch status --watch``'s Ctrl-C,
    whatever the session inherited: a suite started in the background from a script (``make
    test &``) inherits both ignored, and a launcher ignoring them never ends (conftest's
    ``background_ignores_undone``)."""
    code = (
        "import signal\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL)"
    )
    out = leaks.run_python(code)
    assert out.stdout == "True True\n", out.stderr


def test_an_unclosed_context_is_killed_at_interpreter_exit(tmp_path, leaks: LeakCheck) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    code = (
        "import relaunch\n"
        "pc = relaunch.start_processes("
        f"'w', 'sleep', {{0: ('300',)}}, {{0: {{}}}}, {str(log_dir)!r})\n"
        "print(pc.pids()[0], flush=True)\n"
    )
    out = leaks.run_python(code)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: not pid_alive(int(out.stdout)), timeout=1.0, what="the worker to die")
