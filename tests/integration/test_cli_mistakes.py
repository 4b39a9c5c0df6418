"""The relaunch command's surface, run as a real process: a mistake is one line and exit status
2 before anything starts, ``--version`` and ``--help`` say what they should, and every signal of
``--signals-to-handle`` stops a run whatever disposition relaunch inherited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck, pid_alive, wait_until
from conftest import relaunch_cli as relaunch

from relaunch import __version__

pytestmark = pytest.mark.timeout(60)

C10D = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0")
ETCD = ("--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1")


def one_line_usage_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a usage error printed, after checking that it is one: exit status 2, one
    line on stderr, no traceback, nothing on stdout (nothing ran)."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert done.stdout == ""
    return lines[0]


@pytest.fixture
def job(tmp_path) -> str:
    """A script that leaves a file behind if it ever runs."""
    path = tmp_path / "job.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (
            [*C10D, "--rdzv-conf", "join_timout=5"],
            "--rdzv-conf join_timout: not a key of the c10d backend: did you mean join_timeout?",
        ),
        (
            [*ETCD, "--rdzv-conf", "protocol=http,cacrt=/x"],
            "--rdzv-conf cacrt: not a key of the etcd backend: did you mean cacert?",
        ),
        (
            ["--rdzv-conf", "wait=5"],
            "--rdzv-conf wait: not a key of the static backend: it reads rank, join_timeout",
        ),
        (
            ["--nprocs-per-node", "2"],
            "unknown flag --nprocs-per-node: did you mean --nproc-per-node?",
        ),
        (["--max-restart", "3"], "unknown flag --max-restart: did you mean --max-restarts?"),
        (["--max_restart=3"], "unknown flag --max_restart: did you mean --max_restarts?"),
        (["--log-dir", "/proc/relaunch-logs"], "--log-dir /proc/relaunch-logs is under /proc"),
        (
            ["--log-dir", "/sys/kernel/relaunch-logs"],
            "--log-dir /sys/kernel/relaunch-logs is under /sys",
        ),
        (["--state-dir", "/proc/self/state"], "--state-dir /proc/self/state is under /proc"),
    ],
)
def test_a_mistake_is_one_line_naming_the_fix(
    tmp_path, leaks: LeakCheck, job: str, argv: list[str], fix: str
) -> None:
    line = one_line_usage_error(relaunch(leaks, *argv, job, cwd=str(tmp_path)))
    assert line.startswith(f"relaunch: error: {fix}"), line
    assert not (tmp_path / "ran").exists()
    if "/proc" in fix or "/sys" in fix:
        assert "name a directory on disk" in line


def test_torchrun_spellings_still_work_and_worker_arguments_are_untouched(
    tmp_path, leaks: LeakCheck
) -> None:
    """Both spellings of a flag and the rendezvous keys of torch's own backends are taken; what
    follows the script (a misspelled or abbreviated flag among it) is the worker's."""
    out = tmp_path / "out"
    out.mkdir()
    job = tmp_path / "job.py"
    job.write_text(
        "import os, sys\n"
        f"with open(os.path.join({str(out)!r}, os.environ['LOCAL_RANK']), 'w') as f:\n"
        "    f.write(repr(sys.argv[1:]))\n"
    )
    worker_args = ["--max-restart", "3", "--nprocs-per-node", "--rdzv-conf", "join_timout=5"]
    for spelling in ("--nproc-per-node", "--nproc_per_node"):
        done = relaunch(
            leaks,
            spelling,
            "2",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "127.0.0.1:0",
            "--rdzv-conf",
            "join_timeout=30,read_timeout=5,close_timeout=5",
            str(job),
            *worker_args,
            cwd=str(tmp_path),
        )
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(out)) == ["0", "1"]
        assert (out / "1").read_text() == repr(worker_args)
        for name in os.listdir(out):
            os.unlink(out / name)


def test_a_module_that_cannot_be_found_is_one_line(tmp_path, leaks: LeakCheck) -> None:
    line = one_line_usage_error(relaunch(leaks, "-m", "no_such_module_i45", cwd=str(tmp_path)))
    assert line.startswith(
        "relaunch: error: -m no_such_module_i45: no module named 'no_such_module_i45' in "
        f"{tmp_path}, PYTHONPATH or this Python's packages: check the name"
    ), line
    (tmp_path / "train.py").write_text("")
    line = one_line_usage_error(relaunch(leaks, "-m", "train.py", cwd=str(tmp_path)))
    assert "-m train.py: -m takes a module name, not a file: -m train, or drop -m" in line


def test_a_module_is_looked_for_where_the_workers_look(tmp_path, leaks: LeakCheck) -> None:
    """The workers' directory and PYTHONPATH count (not the launcher's own path), and the
    module is not imported by the check: its code runs once per worker only."""
    package = tmp_path / "src" / "mypkg_i45"
    package.mkdir(parents=True)
    ran = tmp_path / "ran"
    ran.mkdir()
    (package / "__init__.py").write_text(
        f"import os\nopen(os.path.join({str(ran)!r}, str(os.getpid())), 'w').close()\n"
    )
    (package / "__main__.py").write_text("")
    done = relaunch(leaks, "-m", "mypkg_i45", cwd=str(tmp_path / "src"))
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(ran)) == 1  # the worker's import, none in the launcher
    env = {**leaks.process_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "-m", "mypkg_i45"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(ran)) == 2


def test_version_prints_the_version(leaks: LeakCheck) -> None:
    done = relaunch(leaks, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"relaunch {__version__}\n"
    assert done.stderr == ""


def test_without_a_script_only_the_script_is_asked_for(leaks: LeakCheck) -> None:
    line = one_line_usage_error(relaunch(leaks, "--nproc-per-node", "2"))
    assert line == (
        "relaunch: error: the following arguments are required: training_script "
        "(see relaunch --help)"
    )


def test_help_names_the_subcommands(leaks: LeakCheck) -> None:
    done = relaunch(leaks, "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "'relaunch status' shows a running job" in text
    assert "'relaunch store' serves the built-in store on its own" in text
    assert "--version" in text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGQUIT, signal.SIGHUP])
def test_a_signal_inherited_ignored_still_stops_the_run(
    tmp_path, leaks: LeakCheck, sig: signal.Signals
) -> None:
    """A shell starts a background job with SIGINT and SIGQUIT ignored (nohup: SIGHUP); each
    signal of --signals-to-handle stops the run all the same, and the workers start with it at
    its default, as under torchrun."""
    pids = tmp_path / "pids"
    pids.mkdir()
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            f"""
            import os, signal, time
            handler = signal.getsignal(signal.{sig.name})
            name = getattr(handler, "__name__", str(handler))
            with open(os.path.join({str(pids)!r}, str(os.getpid())), "w") as f:
                f.write(name)
            time.sleep(300)
            """
        )
    )
    ignoring = (
        "import os, signal, sys; "
        f"signal.signal(signal.{sig.name}, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", ignoring, "-m", "relaunch", "--nproc-per-node", "2", str(job)],
        env=leaks.process_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: len([p for p in pids.iterdir() if p.read_text()]) == 2,
            what="the workers to start",
        )
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + sig, stderr
    assert f"relaunch: stopped by {sig.name}; the workers are gone" in stderr
    workers = [int(p.name) for p in pids.iterdir()]
    assert not any(pid_alive(pid) for pid in workers)
    expected = "default_int_handler" if sig == signal.SIGINT else str(signal.SIG_DFL)
    assert {p.read_text() for p in pids.iterdir()} == {expected}
