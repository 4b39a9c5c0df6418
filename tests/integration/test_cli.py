"""The relaunch command, run as a real process."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import agentfns
import pytest
from conftest import LeakCheck, pid_alive, wait_until
from conftest import relaunch_cli as relaunch

pytestmark = pytest.mark.timeout(60)


def script(tmp_path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_runs_n_workers_with_their_ranks(tmp_path, leaks: LeakCheck) -> None:
    job = script(
        tmp_path,
        """
        import os, sys
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], sys.argv[1:])
    """,
    )
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
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == "logged\n"


def test_failure_prints_the_report_and_exits_1(tmp_path, leaks: LeakCheck) -> None:
    job = script(
        tmp_path,
        """
        import os, time
        if os.environ["RANK"] == "1":
            raise RuntimeError("the data is missing")
        time.sleep(300)
    """,
    )
    done = relaunch(leaks, "--nproc-per-node", "2", "--redirects", "2", job)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    header = "relaunch: job.py failed: 1 worker failed, 1 stopped because of it"
    lines = lines[lines.index(header) :]
    assert "RuntimeError: the data is missing" in done.stderr
    report_end = lines.index(
        "Rank 0 did not fail: relaunch stopped it because of the failure above"
    )
    assert lines[report_end + 1].startswith("relaunch: run summary: failed")
    assert "relaunch/cli.py" not in done.stderr, "no traceback of the launcher's own"
    assert "relaunch/cli/" not in done.stderr, "no traceback of the launcher's own"


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
        (["--no-python", "no-such-binary-xyz"], "'no-such-binary-xyz' was not found"),
        (["-m", "--no-python", "x"], "--module and --no-python cannot be used together"),
        ([], "the following arguments are required"),
        (["--shutdown-timeout", "-1", "x.py"], "--shutdown-timeout"),
        (["--nnodes", "3:1", "x.py"], "MIN must not exceed MAX"),
        (["--nnodes", "two", "x.py"], "expected N or MIN:MAX"),
        (["--max-restarts", "-1", "x.py"], "--max-restarts"),
        (
            ["--rdzv-backend", "zookeeper", "x.py"],
            "valid backends are c10d, tcp, etcd, etcd-v2, static",
        ),
        (["--rdzv-backend", "etcd", "x.py"], "etcd needs --rdzv-endpoint HOST:PORT"),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "protocol=ftp",
                "--no-python",
                "true",
            ],
            "protocol='ftp': expected http or https",
        ),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "cacert=/no/such/ca.pem",
                "--no-python",
                "true",
            ],
            "cacert=/no/such/ca.pem: no such file",
        ),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "h:1,,h:2",
                "--no-python",
                "true",
            ],
            "the endpoint is empty",
        ),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "h:1,h:x",
                "--no-python",
                "true",
            ],
            "endpoint 'h:x' has port 'x'",
        ),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "h:1,h:1",
                "--no-python",
                "true",
            ],
            "the endpoint 'h:1' is named twice",
        ),
        (["--rdzv-backend", "c10d", "x.py"], "c10d needs --rdzv-endpoint HOST:PORT"),
        (["--rdzv-endpoint", "host:port", "x.py"], "expected a number 0..65535"),
        (["--nnodes", "1:2", "x.py"], "needs an elastic rendezvous backend"),
        (
            [
                "--nnodes",
                "1:2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "join_timeout=x",
                "--no-python",
                "true",
            ],
            "join_timeout='x': expected a number",
        ),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank 2 must be below"),
        (["--standalone", "--nnodes", "2", "x.py"], "--standalone runs one node"),
        (["--start-method", "vfork", "x.py"], "invalid choice: 'vfork'"),
        (["--signals-to-handle", "SIGNOPE", "x.py"], "unknown signal 'SIGNOPE'"),
        (["--local-ranks-filter", "a", "x.py"], "expected local ranks"),
        (["--rdzv-conf", "novalue", "x.py"], "expected KEY=VALUE"),
        (["--event-log-handler", "kafka", "x.py"], "kafka"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    leaks: LeakCheck, argv: list[str], message: str
) -> None:
    done = relaunch(leaks, *argv, cwd="/")
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_help_groups_the_flags(leaks: LeakCheck) -> None:
    done = relaunch(leaks, "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for heading in (
        "nodes:",
        "rendezvous:",
        "restarts:",
        "workers:",
        "logs:",
        "--nproc-per-node N",
        "--tee MASK",
        "(default: 1)",
        "--shutdown-timeout SECONDS",
        "(default: 30.0)",
    ):
        assert heading in text
    assert "(default: None)" not in text and "(default: False)" not in text


def start_job_with_grandchildren(
    tmp_path, leaks: LeakCheck
) -> tuple[subprocess.Popen[str], list[int]]:
    """relaunch with 2 workers that each start a grandchild; returns it and all 4 pids."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    job = script(
        tmp_path,
        f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        open(os.path.join({str(pid_dir)!r}, f"{{os.getpid()}}.{{child.pid}}"), "w").close()
        time.sleep(300)
    """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", job],
        env=leaks.process_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: len(os.listdir(pid_dir)) == 2, what="the workers to start")
    return launcher, [int(p) for name in os.listdir(pid_dir) for p in name.split(".")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_workers_and_exits_128_plus_signal(
    tmp_path, leaks: LeakCheck, sig: signal.Signals
) -> None:
    launcher, pids = start_job_with_grandchildren(tmp_path, leaks)
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + sig
    assert f"stopped by {sig.name}" in stderr
    assert not any(pid_alive(pid) for pid in pids)


def test_a_worker_ignoring_sigterm_is_killed_after_the_shutdown_timeout(
    tmp_path, leaks: LeakCheck
) -> None:
    ready = tmp_path / "ready"
    job = script(
        tmp_path,
        f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(300)
    """,
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--shutdown-timeout", "0.5", job],
        env=leaks.process_env(),
        stderr=subprocess.DEVNULL,
    )
    wait_until(ready.exists, what="the worker to start")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM


#: What relaunch is compared with where torch is not installed: torchrun 2.13's names.
TORCHRUN_2_13_NAMES = frozenset(agentfns.CONTRACT)
#: What relaunch adds of its own: the channel of ``stop_requested`` and ``report_progress``,
#: Python's fault handler, so that a hang's SIGABRT prints every rank's stack, the token
#: that finds every descendant of the workers (procs.descendants), where ``save_state``
#: keeps the state and which step ``load_state`` gives (core.state), and where a rank that
#: restarts in place waits (relaunch.in_place).
RELAUNCH_OWN_NAMES = frozenset(
    {
        "RELAUNCH_CHANNEL",
        "RELAUNCH_PARKING",
        "PYTHONFAULTHANDLER",
        "RELAUNCH_TREE",
        "RELAUNCH_STATE_DIR",
        "RELAUNCH_STATE_MEMORY",
        "RELAUNCH_STATE_STEP",
    }
)
#: Compared apart: where they may differ (the port, the run id, the error file's path, the
#: agent store) or how (the address).
COMPARED_APART = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_USE_AGENT_STORE",
    }
)
#: The values both launchers must give alike.
MUST_AGREE = tuple(name for name in agentfns.CONTRACT if name not in COMPARED_APART)
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
DUMP_ENV = """
    import json, os, sys
    with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
        json.dump(dict(os.environ), f)
"""


def has_torchrun() -> bool:
    """Whether torch (hence torchrun) is installed, found without importing it."""
    return importlib.util.find_spec("torch") is not None


def clean_env(leaks: LeakCheck) -> dict[str, str]:
    """The test's environment without any variable a launcher sets, so every one it sets shows."""
    return {
        name: value
        for name, value in leaks.process_env().items()
        if name not in TORCHRUN_2_13_NAMES | RELAUNCH_OWN_NAMES and not name.startswith("PET_")
    }


def dump_envs(
    leaks: LeakCheck, tmp_path, launcher: list[str], nodes: list[list[str]]
) -> dict[int, dict[str, str]]:
    """Run one launcher per entry of ``nodes`` (its flags) together, each with 2 workers that
    dump their environment; what each worker got on top of the launcher's, by global rank."""
    out = pathlib.Path(tempfile.mkdtemp(prefix="envs_", dir=tmp_path))
    job = script(tmp_path, DUMP_ENV, name="dump_env.py")
    base = clean_env(leaks)
    procs = [
        subprocess.Popen(
            [*launcher, "--nproc-per-node", "2", *flags, job, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=base,
        )
        for flags in nodes
    ]
    try:
        for proc in procs:
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    envs = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    return {
        rank: {name: value for name, value in env.items() if base.get(name) != value}
        for rank, env in envs.items()
    }


def is_this_host(addr: str) -> bool:
    """Whether ``addr`` names this machine: every address it resolves to can be bound here."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(sockaddr)
            except OSError:
                return False
    return bool(infos)


def ephemeral(port: str) -> bool:
    """Whether ``port`` is in the kernel's range for ports it picks: a free port, not 29500."""
    text = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
    low, high = map(int, text.split())
    return low <= int(port) <= high


def assert_names_and_values(
    relaunch_envs: dict[int, dict[str, str]],
    torchrun_envs: dict[int, dict[str, str]] | None,
    expected: dict[str, str],
) -> None:
    """relaunch's workers got torchrun's names (plus its own), ``expected`` by rank, and, when
    torchrun ran, the values torchrun's workers got for the names that must agree."""
    assert sorted(relaunch_envs) == list(range(len(relaunch_envs)))
    if torchrun_envs is None:
        names = TORCHRUN_2_13_NAMES
    else:
        assert sorted(torchrun_envs) == sorted(relaunch_envs)
        names = frozenset(torchrun_envs[0])
        if importlib.metadata.version("torch").startswith("2.13."):
            assert names == TORCHRUN_2_13_NAMES, "the written-down list is torchrun 2.13's"
    for rank, env in relaunch_envs.items():
        assert set(env) == names | RELAUNCH_OWN_NAMES, rank
        local_rank = str(rank % int(env["LOCAL_WORLD_SIZE"]))
        assert env["RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == local_rank
        assert {name: env[name] for name in expected} == expected
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{local_rank}/error.json")
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # as torchrun: the agent serves it
        if torchrun_envs is not None:
            theirs = torchrun_envs[rank]
            assert set(theirs) == names, rank
            assert {n: env[n] for n in MUST_AGREE} == {n: theirs[n] for n in MUST_AGREE}
            assert theirs["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{local_rank}/error.json")
            assert theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_the_full_environment_contract_for_several_workers(tmp_path, leaks: LeakCheck) -> None:
    out = tmp_path / "envs"
    out.mkdir()
    job = script(tmp_path, DUMP_ENV)
    done = relaunch(
        leaks,
        "--standalone",
        "--nproc_per_node=3",
        "--role",
        "trainer",
        "--max-restarts",
        "2",
        job,
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "setting OMP_NUM_THREADS=1 for each of the 3 workers" in done.stderr
    envs = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(envs) == [0, 1, 2]
    ports = {env["MASTER_PORT"] for env in envs.values()}
    run_ids = {env["TORCHELASTIC_RUN_ID"] for env in envs.values()}
    assert len(ports) == 1 and len(run_ids) == 1
    assert UUID4.fullmatch(run_ids.pop()), "a fresh uuid4, as torchrun's --standalone gives"
    for rank, env in envs.items():
        expected = {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "trainer",
            "LOCAL_WORLD_SIZE": "3",
            "WORLD_SIZE": "3",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1",
        }
        assert {key: env.get(key) for key in expected} == expected
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")


RELAUNCH = [sys.executable, "-m", "relaunch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.xdist_group("torch")
@pytest.mark.timeout(120)
def test_one_node_gives_torchruns_environment(tmp_path, leaks: LeakCheck) -> None:
    flags = ["--role", "trainer", "--max-restarts", "1"]
    first, second = (dump_envs(leaks, tmp_path, RELAUNCH, [flags]) for _ in range(2))
    theirs = dump_envs(leaks, tmp_path, TORCHRUN, [flags]) if has_torchrun() else None
    expected = {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert_names_and_values(first, theirs, expected)
    runs = [first, second] if theirs is None else [first, second, theirs]
    for envs in runs:
        # One node, no --master-port: a fresh run id (so paths built from it never collide
        # between runs) and a port the kernel found free, on this host, for every rank alike.
        assert len({env["TORCHELASTIC_RUN_ID"] for env in envs.values()}) == 1
        assert UUID4.fullmatch(envs[0]["TORCHELASTIC_RUN_ID"])
        assert len({(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in envs.values()}) == 1
        assert ephemeral(envs[0]["MASTER_PORT"])
        assert is_this_host(envs[0]["MASTER_ADDR"])
    assert first[0]["TORCHELASTIC_RUN_ID"] != second[0]["TORCHELASTIC_RUN_ID"]
    assert first[0]["MASTER_ADDR"] == "127.0.0.1"  # on purpose; torchrun: socket.getfqdn()
    assert theirs is None or theirs[0]["MASTER_ADDR"] == socket.getfqdn()


@pytest.mark.xdist_group("torch")
@pytest.mark.timeout(120)
def test_two_static_nodes_give_torchruns_environment(tmp_path, leaks: LeakCheck) -> None:
    from relaunch.endpoints import find_free_port

    def nodes(port: int) -> list[list[str]]:
        static = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        return [[*static, "--node-rank", str(rank)] for rank in range(2)]

    port = find_free_port("127.0.0.1")
    ours = dump_envs(leaks, tmp_path, RELAUNCH, nodes(port))
    their_port = find_free_port("127.0.0.1")
    theirs = dump_envs(leaks, tmp_path, TORCHRUN, nodes(their_port)) if has_torchrun() else None
    expected = {
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",  # --rdzv-id's default: the static backend keeps it
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert_names_and_values(ours, theirs, expected)
    assert [ours[rank]["GROUP_RANK"] for rank in range(4)] == ["0", "0", "1", "1"]
    if theirs is not None:
        for env in theirs.values():
            assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(their_port))
            assert env["TORCHELASTIC_RUN_ID"] == "none"


def test_pet_environment_variables_set_flags(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "import os; print(os.environ['WORLD_SIZE'])\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", job],
        capture_output=True,
        text=True,
        timeout=50,
        env=leaks.process_env(PET_NPROC_PER_NODE="2", PET_TEE="1", PET_STANDALONE="1"),
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[default0]:2", "[default1]:2"]


def test_a_failed_worker_group_is_restarted(tmp_path, leaks: LeakCheck) -> None:
    job = script(
        tmp_path,
        """
        import os, sys
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"rank {os.environ['RANK']} attempt {attempt}")
        if attempt == "0" and os.environ["RANK"] == "1":
            sys.exit(5)
    """,
    )
    done = relaunch(leaks, "--nproc-per-node", "2", "--max-restarts", "1", "--tee", "1", job)
    assert done.returncode == 0, done.stderr
    assert "restarting the worker group (a worker failed); 0 restart(s) left" in done.stderr
    assert "[default0]:rank 0 attempt 1" in done.stdout.splitlines()
    assert "[default1]:rank 1 attempt 1" in done.stdout.splitlines()


def test_local_ranks_filter_shows_only_those_ranks(tmp_path, leaks: LeakCheck) -> None:
    job = script(tmp_path, "import os; print('hi from', os.environ['LOCAL_RANK'])\n")
    logs = tmp_path / "logs"
    done = relaunch(
        leaks,
        "--nproc-per-node",
        "3",
        "--tee",
        "3",
        "--local-ranks-filter",
        "0,2",
        "--log-dir",
        str(logs),
        job,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[default0]:hi from 0", "[default2]:hi from 2"]
    (run_dir,) = logs.iterdir()
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == "hi from 1\n"


def test_per_rank_tee_map_and_run_path(tmp_path, leaks: LeakCheck) -> None:
    job = script(
        tmp_path,
        """
        import os, sys
        print(__name__, sys.argv[1:], os.environ["LOCAL_RANK"])
    """,
    )
    done = relaunch(leaks, "--nproc-per-node", "2", "--tee", "1:1", "--run-path", job, "a")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[default1]:__main__ ['a'] 1", "__main__ ['a'] 0"]


def test_status_events_go_to_a_json_lines_file(tmp_path, leaks: LeakCheck) -> None:
    events = tmp_path / "events.jsonl"
    job = script(tmp_path, "pass\n")
    done = relaunch(leaks, "--nproc-per-node", "2", "--event-log-handler", f"file:{events}", job)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(line["source"], line["metadata"]["state"]) for line in lines] == [
        ("AGENT", "HEALTHY"),  # the group started (relaunch's; docs/events.md)
        ("WORKER", "SUCCEEDED"),
        ("WORKER", "SUCCEEDED"),
        ("AGENT", "SUCCEEDED"),
    ]


def test_two_static_nodes_form_one_world(tmp_path, leaks: LeakCheck) -> None:
    from relaunch.endpoints import find_free_port

    port = str(find_free_port("127.0.0.1"))
    job = script(
        tmp_path,
        """
        import os
        print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["GROUP_RANK"],
              os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    """,
    )
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relaunch",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "--tee",
                "1",
                job,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=leaks.process_env(),
        )
        for rank in range(2)
    ]
    outputs = [node.communicate(timeout=50)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0]
    lines = sorted(line.split(":", 1)[1] for out in outputs for line in out.splitlines())
    assert lines == [f"{rank} 4 {rank // 2} 127.0.0.1 {port}" for rank in range(4)]


def test_sigkill_of_the_launcher_leaves_no_orphans(tmp_path, leaks: LeakCheck) -> None:
    launcher, pids = start_job_with_grandchildren(tmp_path, leaks)
    launcher.kill()
    launcher.communicate()
    wait_until(
        lambda: not any(pid_alive(pid) for pid in pids),
        timeout=1.0,
        what="every worker and grandchild to die within 1 s",
    )


@pytest.mark.timeout(20)
def test_a_failure_on_a_standalone_node_is_final_at_once(tmp_path, leaks: LeakCheck) -> None:
    """One node has no other node to lose: no grace for a lost node to be noticed (20 s)."""
    job = script(tmp_path, "import sys; sys.exit(3)\n")
    done = relaunch(leaks, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", job)
    assert done.returncode == 1, done.stderr
    assert "exited with code 3" in done.stderr
    assert "waiting up to" not in done.stderr and "lost node" not in done.stderr
