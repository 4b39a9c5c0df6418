"""``relaunch --replica-groups R``, for real: each group its own world, restarts and budget; a
failure in one never stops, signals or restarts another; one node's supervisor forwards a stop
and says how each group ended; on several nodes, a group loses its node and the others go on."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import LeakCheck, pid_alive, relaunch_cli, wait_until

from relaunch.endpoints import find_free_port

pytestmark = pytest.mark.timeout(120)

#: The worker: writes its variables, then does what ``mode`` says. Every wait has a deadline.
WORKER = """
    import json, os, signal, sys, time
    from pathlib import Path

    out, mode = Path(sys.argv[1]), sys.argv[2]
    group, rank = os.environ["REPLICA_GROUP_ID"], os.environ["RANK"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    names = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "RANK", "LOCAL_RANK", "WORLD_SIZE",
             "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    seen = {name: os.environ[name] for name in names}
    seen.update(pid=os.getpid(), agent=os.getppid())
    (out / f"env-g{group}-r{rank}-a{attempt}.json").write_text(json.dumps(seen))

    def wait_for(name):
        deadline = time.monotonic() + 60
        while not (out / name).exists():
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.01)

    if mode == "env":
        print("hello", flush=True)
        sys.exit(0)
    if mode in ("fail", "kill", "exhaust") and group == "1":
        (out / f"g1-a{attempt}").touch()
        wait_for("g0-working")  # group 0 wrote its first line
        if mode == "exhaust" or attempt == 0:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            sys.exit(1)
        (out / "back").touch()
        sys.exit(0)
    if mode in ("fail", "kill", "exhaust"):  # group 0: keeps writing until group 1 is back
        done = "back" if mode != "exhaust" else "g1-a1"
        deadline = time.monotonic() + 60
        with open(out / "g0.log", "a") as log:
            after = 3  # lines once group 1 is back
            while after and time.monotonic() < deadline:
                log.write(f"{os.getpid()} {attempt}\\n")
                log.flush()
                (out / "g0-working").touch()
                after -= (out / done).exists()
                time.sleep(0.01)
        sys.exit(0)
    (out / f"ready-g{group}-r{rank}").touch()  # hold: until told to go
    wait_for("go")
"""


def job(tmp_path: Path) -> tuple[str, Path]:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(WORKER))
    out = tmp_path / "out"
    out.mkdir()
    return str(path), out


def seen(out: Path, group: int, rank: int = 0, attempt: int = 0) -> dict[str, str]:
    return json.loads((out / f"env-g{group}-r{rank}-a{attempt}.json").read_text())


class Launch:
    """A ``relaunch`` started in the background, its stderr in a file read while it runs."""

    def __init__(self, leaks: LeakCheck, tmp_path: Path, name: str, *argv: str) -> None:
        self.err = tmp_path / f"{name}.err"
        with open(self.err, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "relaunch", *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=leaks.process_env(),
                cwd=tmp_path,
            )

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g}s:\n{self.stderr()}") from None
        finally:
            self.proc.kill()  # only when the wait failed: nothing left behind
            self.proc.wait()


def ends(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("relaunch: replica group")]


#: Writes each line in two pieces: on a pipe shared with other groups' workers, another's
#: bytes could land between them unless relaunch copies whole lines.
HALVES = """
    import os, sys, time
    from pathlib import Path

    out, group = Path(sys.argv[1]), os.environ["REPLICA_GROUP_ID"]
    (out / f"ready{group}").touch()
    deadline = time.monotonic() + 30  # all groups write at once
    while len(list(out.glob("ready*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    for _ in range(5000):
        os.write(1, b"group" + group.encode() + b" ")
        os.write(1, b"x" * 50 + b"\\n")
"""


def test_groups_of_one_worker_never_mix_within_a_line(tmp_path: Path, leaks: LeakCheck) -> None:
    """One worker per group, no tee: the groups share one console, so each group's lines are
    copied whole (before: hundreds of lines mixed in most runs)."""
    script = tmp_path / "halves.py"
    script.write_text(textwrap.dedent(HALVES))
    done = relaunch_cli(leaks, "--standalone", "--replica-groups", "3", str(script), str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 15000
    mixed = [line for line in lines if not re.fullmatch(r"group[0-2] x{50}", line)]
    assert not mixed, mixed[:5]


@pytest.mark.parametrize("count", [2, 3])
def test_each_group_is_its_own_world_with_its_own_variables_and_logs(
    tmp_path: Path, leaks: LeakCheck, count: int
) -> None:
    script, out = job(tmp_path)
    logs = tmp_path / "logs"
    argv = ("--standalone", "--replica-groups", str(count), "--nproc-per-node", "2", "--tee", "3")
    done = relaunch_cli(leaks, *argv, "--log-dir", str(logs), script, str(out), "env")
    assert done.returncode == 0, done.stderr
    ports = set()
    for group in range(count):
        envs = [seen(out, group, rank) for rank in range(2)]
        assert [env["RANK"] for env in envs] == ["0", "1"]
        assert {env["WORLD_SIZE"] for env in envs} == {"2"}
        assert {env["REPLICA_GROUP_ID"] for env in envs} == {str(group)}
        assert {env["NUM_REPLICA_GROUPS"] for env in envs} == {str(count)}
        assert {env["TORCHELASTIC_RUN_ID"] for env in envs} == {envs[0]["TORCHELASTIC_RUN_ID"]}
        assert envs[0]["TORCHELASTIC_RUN_ID"].endswith(f"-group{group}")
        ports.add(envs[0]["MASTER_PORT"])
        assert f"[g{group} default1]:hello" in done.stdout.splitlines()  # the group's prefix
        assert len(list(logs.glob(f"*-group{group}_*"))) == 1
    assert len(ports) == count  # each group its own MASTER_PORT
    assert ends(done.stderr) == [
        f"relaunch: replica group {group}: succeeded, 0 restarts" for group in range(count)
    ]


@pytest.mark.parametrize("mode", ["fail", "kill"])
def test_a_failed_group_restarts_alone_and_the_other_keeps_working(
    tmp_path: Path, leaks: LeakCheck, mode: str
) -> None:
    script, out = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", "--max-restarts", "2")
    done = relaunch_cli(leaks, *argv, "--restart-backoff", "0:0", script, str(out), mode)
    assert done.returncode == 0, done.stderr
    assert seen(out, 1, attempt=1)["TORCHELASTIC_RUN_ID"].endswith("-group1")  # restarted
    assert not (out / "env-g0-r0-a1.json").exists()  # group 0: never restarted
    written = (out / "g0.log").read_text().split()
    pids, attempts = set(written[0::2]), set(written[1::2])
    # one process of group 0, on its first attempt, writing before and after the restart
    assert pids == {str(seen(out, 0)["pid"])} and attempts == {"0"}
    assert len(written) >= 2 * 4  # before group 1 failed, and 3 lines after it came back
    assert ends(done.stderr) == [
        "relaunch: replica group 0: succeeded, 0 restarts",
        "relaunch: replica group 1: succeeded, 1 restart",
    ]


def test_a_group_out_of_restarts_fails_while_the_others_finish(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script, out = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", "--max-restarts", "1")
    done = relaunch_cli(leaks, *argv, "--restart-backoff", "0:0", script, str(out), "exhaust")
    assert done.returncode == 1, done.stderr
    assert not (out / "env-g0-r0-a1.json").exists()
    assert ends(done.stderr) == [
        "relaunch: replica group 0: succeeded, 0 restarts",
        "relaunch: replica group 1: failed (exit status 1), 1 restart",
    ]


def test_sigterm_to_the_supervisor_stops_every_group(tmp_path: Path, leaks: LeakCheck) -> None:
    script, out = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", script, str(out), "hold")
    launch = Launch(leaks, tmp_path, "supervisor", *argv)
    try:
        wait_until(lambda: len(list(out.glob("ready-*"))) == 2, 60, "both groups running")
        launch.proc.send_signal(signal.SIGTERM)
    finally:
        status = launch.wait()
    assert status == 128 + signal.SIGTERM, launch.stderr()
    assert ends(launch.stderr()) == [
        "relaunch: replica group 0: stopped (exit status 143), 0 restarts",
        "relaunch: replica group 1: stopped (exit status 143), 0 restarts",
    ]


def test_status_of_the_job_shows_every_group(tmp_path: Path, leaks: LeakCheck) -> None:
    script, out = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", script, str(out), "hold")
    launch = Launch(leaks, tmp_path, "supervisor", *argv)
    try:
        wait_until(lambda: len(list(out.glob("ready-*"))) == 2, 60, "both groups running")
        said = re.search(
            r"relaunch status (--rdzv-endpoint \S+) --rdzv-id (\S+)\)", launch.stderr()
        )
        assert said, launch.stderr()
        rg = said[2]
        status = [sys.executable, "-m", "relaunch", "status", *said[1].split()]
        shown = subprocess.run(
            [*status, "--rdzv-id", rg], capture_output=True, text=True, timeout=30
        )
        as_json = subprocess.run(
            [*status, "--rdzv-id", rg, "--json"], capture_output=True, text=True, timeout=30
        )
        one = subprocess.run(
            [*status, "--rdzv-id", f"{rg}-group1"], capture_output=True, text=True, timeout=30
        )
        (out / "go").touch()
    finally:
        code = launch.wait()
    assert code == 0, launch.stderr()
    assert shown.returncode == 0, shown.stderr
    assert f"replica group 0 of 2:\njob {rg}-group0:" in shown.stdout
    assert f"replica group 1 of 2:\njob {rg}-group1:" in shown.stdout
    data = json.loads(as_json.stdout)
    assert data["run_id"] == rg
    assert [g["run_id"] for g in data["replica_groups"]] == [f"{rg}-group0", f"{rg}-group1"]
    assert one.returncode == 0 and one.stdout.startswith(f"job {rg}-group1:"), one.stdout


def test_a_supervisor_killed_outright_takes_its_groups_with_it(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script, out = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", script, str(out), "hold")
    launch = Launch(leaks, tmp_path, "supervisor", *argv)
    try:
        wait_until(lambda: len(list(out.glob("ready-*"))) == 2, 60, "both groups running")
        workers = [int(seen(out, g)["pid"]) for g in (0, 1)]
        agents = [int(seen(out, g)["agent"]) for g in (0, 1)]
        launch.proc.kill()
        launch.proc.wait(30)
        pids = workers + agents
        wait_until(lambda: not any(map(pid_alive, pids)), 60, "agents and workers gone")
    finally:
        launch.wait()


def test_a_killed_group_agent_is_said_and_the_other_group_goes_on(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script, out = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", script, str(out), "hold")
    launch = Launch(leaks, tmp_path, "supervisor", *argv)
    said = "relaunch: replica group 1: its agent was killed by SIGKILL; the other groups go on"
    try:
        wait_until(lambda: len(list(out.glob("ready-*"))) == 2, 60, "both groups running")
        os.kill(int(seen(out, 1)["agent"]), signal.SIGKILL)  # group 1's agent, by its pid
        wait_until(lambda: said in launch.stderr(), 30, "the supervisor to say so")
        (out / "go").touch()  # group 0 still runs: it finishes now
    finally:
        status = launch.wait()
    assert status == 128 + signal.SIGKILL, launch.stderr()
    assert ends(launch.stderr())[-2:] == [
        "relaunch: replica group 0: succeeded, 0 restarts",
        "relaunch: replica group 1: its agent was killed by SIGKILL (exit status 137), 0 restarts",
    ]


def test_two_nodes_each_a_group_and_a_killed_node_leaves_the_other_running(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script, out = job(tmp_path)
    endpoint = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    flags = ("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two")
    flags += ("--nnodes", "2", "--replica-groups", "2")
    nodes: list[Launch] = []
    try:
        for rank in range(2):  # node 0 first: it hosts the job's store
            argv = (*flags, "--node-rank", str(rank), script, str(out), "hold")
            nodes.append(Launch(leaks, tmp_path, f"node{rank}", *argv))
            wait_until(lambda: serving(endpoint), 60, "the store")
        wait_until(lambda: len(list(out.glob("ready-*"))) == 2, 60, "both groups running")
        for group in range(2):
            env = seen(out, group)
            assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == ("0", "1", "0")
            assert env["TORCHELASTIC_RUN_ID"] == f"two-group{group}"
            assert env["NUM_REPLICA_GROUPS"] == "2"
        # node 1's agent: node 0's hosts the job's store (docs/replica-groups.md)
        nodes[1].proc.send_signal(signal.SIGKILL)
        assert nodes[1].wait() == -signal.SIGKILL
        (out / "go").touch()
        assert nodes[0].wait() == 0, nodes[0].stderr()
    finally:
        for node in nodes:
            node.wait()
    assert not (out / "env-g0-r0-a1.json").exists()


def serving(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def test_bad_replica_groups_are_one_line_usage_errors(tmp_path: Path, leaks: LeakCheck) -> None:
    script, _ = job(tmp_path)
    for argv, said in [
        (("--replica-groups", "0"), "--replica_groups: expected a whole number >= 1, got '0'"),
        (
            ("--replica-groups", "2", "--replica-group", "2"),
            "--replica-group 2 is not one of --replica-groups 2: give 0..1",
        ),
    ]:
        done = relaunch_cli(leaks, *argv, script, cwd=str(tmp_path))
        assert done.returncode == 2
        assert len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr


def test_the_dry_run_shows_each_group(tmp_path: Path, leaks: LeakCheck) -> None:
    script, _ = job(tmp_path)
    argv = ("--standalone", "--replica-groups", "2", "--nproc-per-node", "2", "--dry-run")
    done = relaunch_cli(leaks, *argv, script, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("relaunch: 2 replica groups of 2 worker(s) on this node")
    for group in range(2):
        assert f"replica group {group} (run id " in text
        assert text.count(f"REPLICA_GROUP_ID={group}") == 2
    assert text.count("NUM_REPLICA_GROUPS=2") == 4
    assert "MASTER_PORT: a free port at the start" in text
