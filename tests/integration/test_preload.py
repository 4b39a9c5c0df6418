"""``--preload``: Python workers forked from a zygote that imported the named modules.

The real ``relaunch`` command runs ``preload_worker.py`` (or ``-m preload_worker``) cold and
preloaded; each worker writes what it sees at its first line (argv, ``__main__``, ``sys.path``,
environment, signals, session, CPUs, streams, descriptors...), and the two must agree but for
what names the run (its id, port, paths) and the parent (the zygote). Then: exit statuses and
failure reports, restarts from the same zygote, a zygote killed and started again, nothing
left behind (the agent SIGKILLed included), a module that cannot be imported, and torch.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
from conftest import LeakCheck, marked_pids, relaunch_cli, wait_until

from relaunch.config import ConfigError, LaunchConfig
from relaunch.endpoints import find_free_port
from relaunch.procs.zygote import Zygote
from relaunch.procs.zygote_command import python_command, startup_variables

pytestmark = pytest.mark.timeout(120)

WORKER = pathlib.Path(__file__).with_name("preload_worker.py")
#: What differs from one run to the next, cold or not: the run's id, port, files and token.
PER_RUN = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "PRELOAD_TEST_OUT"}


@pytest.fixture
def workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory with the worker in it (the workers' cwd: ``-m`` finds it there)."""
    shutil.copy(WORKER, tmp_path / WORKER.name)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "hang").mkdir()
    return tmp_path


def run(
    leaks: LeakCheck,
    workdir: pathlib.Path,
    tag: str,
    action: str,
    *flags: str,
    module: bool = False,
    timeout: float = 90,
) -> subprocess.CompletedProcess[str]:
    """``relaunch --nproc-per-node 2 FLAGS preload_worker.py ACTION``, on one CPU; the workers
    write what they see in ``out/TAG`` (``PRELOAD_TEST_OUT``: the same command in every run)."""
    target = ["-m", "preload_worker"] if module else [WORKER.name]
    (workdir / "out" / tag).mkdir()
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "relaunch",
            "--nproc-per-node",
            "2",
            *flags,
            *target,
            action,
        ],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=leaks.process_env(PRELOAD_TEST_OUT=f"out/{tag}"),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )


def seen(workdir: pathlib.Path, tag: str, restart: int, rank: int) -> dict[str, Any]:
    with open(workdir / "out" / tag / f"w-{restart}-{rank}.json") as file:
        return json.load(file)  # type: ignore[no-any-return]


def _comparable(view: dict[str, Any]) -> dict[str, Any]:
    """What must be the same cold and preloaded: all but the parent, the times, the pid, and
    what names the run."""
    view = dict(view)
    for name in ("time", "ppid", "pid", "modules", "parent", "gc_frozen"):
        view.pop(name)
    view["environ"] = {
        name: value
        for name, value in view["environ"].items()
        if name not in PER_RUN and not name.startswith("RELAUNCH_")
    }
    view["environ_names"] = sorted(view["environ"])
    return view


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_a_preloaded_worker_starts_as_a_cold_one(
    leaks: LeakCheck, workdir: pathlib.Path, module: bool
) -> None:
    cold = run(leaks, workdir, "cold", "exit0", module=module)
    warm = run(leaks, workdir, "warm", "exit0", "--preload", "json", module=module)
    assert cold.returncode == 0, cold.stderr
    assert warm.returncode == 0, warm.stderr
    assert sorted(cold.stdout.splitlines()) == sorted(warm.stdout.splitlines())
    zygotes = set()
    for rank in (0, 1):
        before, after = seen(workdir, "cold", 0, rank), seen(workdir, "warm", 0, rank)
        assert before["c_environ_matches"] and after["c_environ_matches"]
        assert after["session_leader"] and after["group_leader"]
        assert after["affinity"] == before["affinity"] == [min(os.sched_getaffinity(0))]
        assert "json" not in before["modules"] and "json" in after["modules"]
        # What a preloaded worker has more of: json's modules and a few small ones of the
        # standard library that the zygote itself uses (never relaunch's).
        extra = set(after["modules"]) - set(before["modules"])
        assert not {name for name in extra if name.startswith("relaunch")}
        assert extra <= {"json", "json.decoder", "json.scanner", "json.encoder", "_json"} | {
            "_socket",
            "select",
            "_ctypes",
            "_struct",
            "struct",
            "gc",
        }, extra
        assert set(before["modules"]) <= set(after["modules"])
        assert _comparable(after) == _comparable(before)
        assert "preload=json" in after["parent"] and "preload=" not in before["parent"]
        assert before["gc_frozen"] == 0 < after["gc_frozen"]  # the zygote's objects: frozen
        zygotes.add(after["ppid"])
    assert len(zygotes) == 1  # one zygote forked both


def test_a_collection_in_a_preloaded_worker_copies_none_of_the_zygotes_pages(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    """The objects the preloaded modules leave are frozen in the zygote: a worker's full
    collection never walks them, so it copies none of the pages it shares with the zygote
    (walking 300,000 lists copies 21 MB)."""
    (workdir / "preload_held.py").write_text("HELD = [[n] for n in range(300_000)]\n")
    done = run(leaks, workdir, "collect", "collect", "--preload", "preload_held")
    assert done.returncode == 0, done.stderr
    copied = [int(line.split()[-1]) for line in done.stdout.splitlines() if "copied" in line]
    assert len(copied) == 2 and max(copied) < 4 << 10, done.stdout  # KiB


def test_exit_statuses_and_failure_reports_are_a_cold_workers(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    for action in ("exit3", "raise"):
        cold = run(leaks, workdir, f"cold-{action}", action, "--tee", "2")
        warm = run(leaks, workdir, f"warm-{action}", action, "--tee", "2", "--preload", "json")
        assert cold.returncode == warm.returncode == 1, warm.stderr
        code = 3 if action == "exit3" else 1
        assert f"exited with code {code}" in warm.stderr
        if action == "raise":
            # The worker's traceback, as a cold one prints it (no zygote frames), reaches
            # the failure report.
            for result in (cold, warm):
                assert "ValueError: boom from rank" in result.stderr
            assert _traceback(warm.stderr) == _traceback(cold.stderr)
            assert "_zygote" not in warm.stderr


def _traceback(stderr: str) -> list[str]:
    """The traceback lines of local rank 0 as tee'd (prefix ``[default0]:``), once each."""
    lines = [line.split(":", 1)[1] for line in stderr.splitlines() if line.startswith("[default0]")]
    return sorted(set(lines))


def test_restarted_workers_are_forked_from_the_same_zygote(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    result = run(
        leaks, workdir, "kill", "kill-self-once", "--max-restarts", "1", "--preload", "json"
    )
    assert result.returncode == 0, result.stderr
    assert "SIGKILL" in result.stderr  # attempt 0's rank 0, reported as killed
    first = [seen(workdir, "kill", 0, rank) for rank in (0, 1)]
    second = [seen(workdir, "kill", 1, rank) for rank in (0, 1)]
    zygote = first[0]["ppid"]
    for view in (*first, *second):
        assert view["ppid"] == zygote  # not relaunch: the same zygote, attempt after attempt
        assert "json" in view["modules"]


def test_a_zygote_that_dies_is_started_again(leaks: LeakCheck, workdir: pathlib.Path) -> None:
    result = run(
        leaks, workdir, "zygote", "kill-zygote-once", "--max-restarts", "1", "--preload", "json"
    )
    assert result.returncode == 0, result.stderr
    first = [seen(workdir, "zygote", 0, rank) for rank in (0, 1)]
    second = [seen(workdir, "zygote", 1, rank) for rank in (0, 1)]
    # Its workers died with it (SIGKILL), the group restarted, from a new zygote.
    assert "SIGKILL" in result.stderr
    assert first[0]["ppid"] == first[1]["ppid"]
    assert second[0]["ppid"] == second[1]["ppid"] != first[0]["ppid"]
    assert all("json" in view["modules"] for view in second)


def test_nothing_is_left_after_the_agent_is_sigkilled(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relaunch",
            "--nproc-per-node",
            "2",
            "--preload",
            "json",
            WORKER.name,
            "hang",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=workdir,
        env=leaks.process_env(PRELOAD_TEST_OUT="out/hang"),
    )
    try:
        assert agent.stdout is not None
        ready = 0
        while ready < 2:
            line = agent.stdout.readline()
            assert line, "relaunch ended before its workers were ready"
            ready += line.strip() == "ready"
        workers = [seen(workdir, "hang", 0, rank) for rank in (0, 1)]
        zygote = workers[0]["ppid"]
        assert zygote in marked_pids(leaks.mark)
        agent.kill()
        agent.wait(10)
        # The zygote goes at the end of its socket (and by its parent-death signal), the
        # workers with it and by the guardian: none of them is left.
        pids = {zygote, *(worker["pid"] for worker in workers)}
        wait_until(
            lambda: not pids & set(marked_pids(leaks.mark)), 10, "the zygote and its workers"
        )
        agent.stdout.close()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_nothing_is_left_after_a_run(leaks: LeakCheck, workdir: pathlib.Path) -> None:
    result = run(leaks, workdir, "done", "exit0", "--preload", "json")
    assert result.returncode == 0, result.stderr
    zygote = seen(workdir, "done", 0, 0)["ppid"]
    assert not os.path.exists(f"/proc/{zygote}")  # closed (and reaped) before relaunch returned


def test_a_module_that_starts_a_thread_leaves_the_workers_cold(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    # Found where the workers' imports look first: the script's directory (sys.path[0]).
    (workdir / "threader.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), name='ticker', daemon=True).start()\n"
    )
    result = run(leaks, workdir, "threads", "exit0", "--preload", "threader")
    assert result.returncode == 0, result.stderr
    assert "started Python threads (ticker)" in result.stderr
    for rank in (0, 1):
        view = seen(workdir, "threads", 0, rank)
        assert "preload=" not in view["parent"] and "threader" not in view["modules"]


def test_a_module_that_cannot_be_imported_is_a_usage_error(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    result = relaunch_cli(
        leaks, "--preload", "nosuchmodule", WORKER.name, "exit0", cwd=str(workdir)
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines == [
        "relaunch: error: --preload nosuchmodule: cannot import nosuchmodule: "
        "ModuleNotFoundError: No module named 'nosuchmodule' (see relaunch --help)"
    ]
    bad = relaunch_cli(leaks, "--preload", "torch,no-such", WORKER.name, cwd=str(workdir))
    assert bad.returncode == 2
    assert "'no-such' is not a module name" in bad.stderr
    assert len(bad.stderr.splitlines()) == 1


def test_the_config_takes_module_names() -> None:
    config = LaunchConfig(1, 1, 2, preload=["torch", "numpy.linalg"])  # type: ignore[arg-type]
    assert config.preload == ("torch", "numpy.linalg")
    assert LaunchConfig(1, 1, 1).preload == ()
    for bad in ("torch", ("torch.",), ("no-such",), (3,)):
        with pytest.raises(ConfigError, match="preload"):
            LaunchConfig(1, 1, 1, preload=bad)  # type: ignore[arg-type]


def test_which_commands_the_zygote_runs() -> None:
    python = sys.executable
    command = python_command([python, "-u", "train.py", "--lr", "1"])
    assert command is not None
    assert (command.options, command.script, command.args) == (("-u",), "train.py", ("--lr", "1"))
    module = python_command([python, "-u", "-m", "pkg.train", "-x"])
    assert module is not None and (module.module, module.args) == ("pkg.train", ("-x",))
    assert module.sys_argv == ["-m", "-x"]
    for cold in (
        [python, "-c", "print(1)"],
        [python, "-O", "train.py"],
        [python, "-u", "-u", "train.py"],
        [python, "-X", "dev", "train.py"],
        [python, "-"],
        [python],
        ["/bin/bash", "-u", "train.py"],
    ):
        assert python_command(cold) is None, cold
    assert startup_variables({"PYTHONPATH": "x", "LANG": "C", "RANK": "0"}) == {
        "PYTHONPATH": "x",
        "LANG": "C",
    }


def test_what_the_zygote_cannot_reproduce_starts_cold(
    leaks: LeakCheck, workdir: pathlib.Path
) -> None:
    script = str(workdir / WORKER.name)
    argv = [sys.executable, "-u", script, "exit0"]
    command = python_command(argv)
    assert command is not None
    env = leaks.process_env()
    zygote = Zygote(["json"], command, env)
    try:
        zygote.start()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            # Another interpreter option, another sys.path[0], a startup variable changed:
            # each starts cold (None), and the zygote is never asked.
            assert zygote.spawn([sys.executable, "-O", script], env, devnull, devnull) is None
            assert zygote.spawn([sys.executable, "-u", "/x/y.py"], env, devnull, devnull) is None
            changed = {**env, "PYTHONHASHSEED": "7"}
            assert zygote.spawn(argv, changed, devnull, devnull) is None
            assert zygote.started == 1 and zygote.ready is None
            # What it can run, it forks: a handle as Popen's, with the exit status.
            sleeper = [*argv[:3], "hang"]
            rank = {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
            out = {"PRELOAD_TEST_OUT": str(workdir / "out")}
            handle = zygote.spawn(sleeper, {**env, **rank, **out}, devnull, devnull)
            assert handle is not None
            assert handle.wait(0.05) is None and handle.poll() is None
            wait_until(lambda: (workdir / "out" / "w-0-0.json").exists(), 30, "the worker")
            os.killpg(handle.pid, signal.SIGTERM)
            assert handle.wait(10) == -signal.SIGTERM
            handle.release()
        finally:
            os.close(devnull)
    finally:
        zygote.close()
    assert zygote.pid is None


@pytest.mark.timeout(240)
@pytest.mark.xdist_group("torch")
def test_torch_preloaded_workers_all_reduce(leaks: LeakCheck, tmp_path: pathlib.Path) -> None:
    script = tmp_path / "reduce.py"
    script.write_text(
        "import sys\n"
        "PRELOADED = 'torch' in sys.modules\n"
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='env://')\n"
        "value = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(value)\n"
        "print(f'rank {dist.get_rank()}: preloaded={PRELOADED} sum={value.item():g}')\n"
        "dist.destroy_process_group()\n"
    )
    result = relaunch_cli(
        leaks,
        "--nproc-per-node",
        "2",
        "--preload",
        "torch",
        "--tee",
        "1",
        str(script),
        cwd=str(tmp_path),
        timeout=200,
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"rank {rank}: preloaded=True sum=3" in result.stdout


AGENT_STORE_WORKER = """
import os, pathlib, sys
from datetime import timedelta
import torch, torch.distributed as dist

rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
# A client of torch's store before init_process_group, on every rank: only a store that no
# worker serves answers it.
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timedelta(seconds=30)
)
store.add("ranks", 1)
dist.init_process_group("gloo")
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
dist.barrier()
seen = f"{os.environ['TORCHELASTIC_USE_AGENT_STORE']} {store.add('ranks', 0)} {value.item():g}"
pathlib.Path(sys.argv[1], f"{attempt}.{rank}").write_text(seen)
store.set(f"written{attempt}.{rank}", "")
if (attempt, rank) == ("0", 1):
    store.wait(["written0.0"])  # rank 0 wrote what it saw before this failure stops it
    os._exit(3)  # before the barrier: rank 0 cannot end the attempt as a success
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
@pytest.mark.xdist_group("torch")
@pytest.mark.parametrize("layout", ["static", "two-nodes"])
def test_with_torch_preloaded_the_agent_serves_torchs_store(
    leaks: LeakCheck, tmp_path: pathlib.Path, request: pytest.FixtureRequest, layout: str
) -> None:
    """Every rank reaches torch's store as a client before any worker serves one
    (``TORCHELASTIC_USE_AGENT_STORE=True``), through a restart on the same port (static) or
    with the other node's rank (two nodes); each attempt has a store of its own."""
    pytest.importorskip("torch")
    from test_state import run_two_nodes

    script = tmp_path / "agent_store.py"
    script.write_text(AGENT_STORE_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    if layout == "static":
        result = relaunch_cli(
            leaks,
            *("--nproc-per-node", "2", "--max-restarts", "1", "--preload", "torch"),
            *("--rdzv-backend", "static", "--master-port", str(find_free_port())),
            *("--tee", "2", str(script), str(out)),
            cwd=str(tmp_path),
            timeout=200,
        )
        assert result.returncode == 0, result.stderr
    else:
        run_two_nodes(
            leaks,
            request,
            "c10d",
            f"agent-store-{os.getpid()}",
            [str(script), str(out)],
            ("--preload", "torch"),
        )
    for attempt in (0, 1):
        for rank in (0, 1):
            assert (out / f"{attempt}.{rank}").read_text() == "True 2 3", (attempt, rank)
