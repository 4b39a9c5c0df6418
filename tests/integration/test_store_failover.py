"""The built-in store outlives its host (issue 28, item 1; docs/store-failover.md): three real
agents on three loopback addresses (127.0.0.1-3, one port), ``--rdzv-endpoint`` naming all three.
The first hosts the store, the others serve standbys; when the host is lost, the survivors move
the store to the first standby and re-form without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import LeakCheck, pid_alive, wait_until
from test_rendezvous import Rendezvous, script
from test_spares_and_health import Node, start, stop_all

from relaunch.core.run.exclusion import decode_record
from relaunch.endpoints import find_free_port
from relaunch.store.api import StoreError
from relaunch.store.client import TcpStore

pytestmark = pytest.mark.timeout(120)

INTERVAL, ATTEMPTS = 0.5, 3
#: Failover needs the job's token on every node.
TOKEN = "failover-token"
#: The first round waits for all three nodes (a long last call); a lost node is known after
#: 1.5 s of silence.
CONF = (
    f"keep_alive_interval={INTERVAL},keep_alive_max_attempt={ATTEMPTS},"
    f"last_call_timeout=5,join_timeout=30,token={TOKEN}"
)
DETECTION = INTERVAL * ATTEMPTS
FLAGS = ("--nnodes", "2:3", "--max-restarts", "3", "--rdzv-conf", CONF)
#: Beyond the budget (detection + 2 s), what a loaded two-core machine may add.
SLACK = 4.0

#: Each attempt of each worker leaves a record; the first attempt's rank 2 fails once (a
#: restart the job counts, and a failure on its node's record, which must survive the store's
#: move); a world of 3 then waits to be re-formed, and a world of 2 finishes once the test
#: has looked at the moved store (its marker ``finish``).
JOB = """
    import json, os, time
    record = {name: os.environ[name] for name in
              ("RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")}
    record["pid"], record["agent"] = os.getpid(), os.getppid()
    name = f"{os.environ['RANK']}.{os.environ['WORLD_SIZE']}.{os.getpid()}"
    with open(os.path.join(os.environ["RECORDS"], name), "w") as out:
        json.dump(record, out)
    if os.environ["WORLD_SIZE"] == "3":
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "2":
            raise SystemExit("the first attempt's rank 2 fails once")
        time.sleep(90)
    finish, deadline = os.path.join(os.environ["RECORDS"], "..", "finish"), time.time() + 60
    while not os.path.exists(finish) and time.time() < deadline:
        time.sleep(0.05)
"""


def _records(folder: Path) -> list[dict[str, object]]:
    found = []
    for name in os.listdir(folder):
        try:
            found.append(json.loads((folder / name).read_text()))
        except ValueError:
            continue  # being written
    return found


def _restarted_world_of_3(folder: Path) -> list[dict[str, object]]:
    return [
        r
        for r in _records(folder)
        if r["WORLD_SIZE"] == "3" and r["TORCHELASTIC_RESTART_COUNT"] != "0"
    ]


def _until_a_world_of_2(folder: Path, lost_at: float) -> float:
    """Seconds from ``lost_at`` (the host's loss) until a survivor's worker ran in a world of
    2, waited for within the budget (detection + 2 s) and a loaded machine's slack."""
    wait_until(
        lambda: any(r["WORLD_SIZE"] == "2" for r in _records(folder)),
        DETECTION + 2 + SLACK,
        "the survivors' workers in a world of 2",
    )
    return time.monotonic() - lost_at


def _serving(host: str, port: int) -> bool:
    try:
        with TcpStore(host, port, TOKEN, timeout=1, connect_timeout=0.2) as store:
            store.get("relaunch/probe")
    except StoreError:
        return False
    return True


def _nodes(
    tmp_path: Path, leaks: LeakCheck, records: Path, names: str = "abc", body: str = JOB
) -> tuple[list[Node], Rendezvous, int]:
    """An agent for each of ``names``, the first hosting the store; the endpoint names three
    hosts whatever their number."""
    port = find_free_port("127.0.0.1")
    endpoints = ",".join(f"127.0.0.{n}:{port}" for n in (1, 2, 3))
    rdzv = Rendezvous("c10d", endpoints, lambda: True, uuid.uuid4().hex[:12])
    job = script(tmp_path, body)
    env = {"RECORDS": str(records)}
    nodes = [start(tmp_path, leaks, rdzv, names[0], job, *FLAGS, env=env)]
    wait_until(lambda: _serving("127.0.0.1", port), 30, "the first agent to host the store")
    nodes += [start(tmp_path, leaks, rdzv, name, job, *FLAGS, env=env) for name in names[1:]]
    return nodes, rdzv, port


def _three_nodes(tmp_path: Path, leaks: LeakCheck, records: Path) -> tuple[list[Node], int]:
    nodes, _, port = _nodes(tmp_path, leaks, records)
    (tmp_path / "finish").touch()  # the world of 2 finishes at once
    return nodes, port


def test_the_store_hosts_sigkill_moves_the_store_and_the_survivors_finish(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    nodes: list[Node] = []
    try:
        nodes, rdzv, port = _nodes(tmp_path, leaks, records)
        host = nodes[0]
        wait_until(lambda: len(_restarted_world_of_3(records)) == 3, 60, "a restarted world of 3")
        assert _serving("127.0.0.1", port) and not _serving("127.0.0.2", port)
        host.proc.send_signal(signal.SIGKILL)
        host.wait()
        took = _until_a_world_of_2(records, time.monotonic())
        # The moved store holds the job's history: the restart spent before the move, and the
        # failure counted on the failing node's record (all three agents share this host's
        # name, so one record).
        with TcpStore("127.0.0.2", port, TOKEN, timeout=5) as moved:
            assert moved.get(f"relaunch/{rdzv.run_id}/restarts").value == b"1"
            record = moved.get(f"relaunch/{rdzv.run_id}/nodes/{os.uname().nodename}").value
        assert decode_record(record).failures == 1, record
        (tmp_path / "finish").touch()
        survivors = nodes[1:]
        for node in survivors:
            assert node.wait() == 0, node.stderr()
    finally:
        (tmp_path / "finish").touch()
        stop_all(nodes)
    waiting = [r for r in _records(records) if r["WORLD_SIZE"] == "2"]
    assert sorted(str(r["RANK"]) for r in waiting) == ["0", "1"], waiting
    # The restart counted before the move is the job's still: the store kept it.
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in waiting} != {"0"}, waiting
    for node in survivors:
        err = node.stderr()
        assert "the store moved to 127.0.0.2:" in err, err
        assert "Traceback" not in err, err
    print(f"store host SIGKILL -> survivors' workers again: {took:.2f}s")
    for record_ in _records(records):
        wait_until(lambda r=record_: not pid_alive(int(str(r["pid"]))), 10, "every worker gone")


def test_a_silent_store_host_is_replaced_and_fenced_when_it_comes_back(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    """The host's whole node goes silent (SIGSTOP: no FIN, no refusal): the survivors move the
    store after the detection time. Resumed, the old host finds that a majority no longer beats
    into its store: the store fences itself and the old host stops, saying so."""
    records = tmp_path / "records"
    records.mkdir()
    nodes: list[Node] = []
    stopped: list[int] = []
    try:
        nodes, _ = _three_nodes(tmp_path, leaks, records)
        host = nodes[0]
        wait_until(lambda: len(_restarted_world_of_3(records)) == 3, 60, "a restarted world of 3")
        host_workers = [
            int(str(r["pid"]))
            for r in _restarted_world_of_3(records)
            if r["agent"] == host.proc.pid
        ]
        stopped = [host.proc.pid, *host_workers]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        took = _until_a_world_of_2(records, time.monotonic())
        for node in nodes[1:]:
            assert node.wait() == 0, node.stderr()
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped = []
        assert host.wait(30) == 1, host.stderr()
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stop_all(nodes)
    err = host.stderr()
    assert "relaunch: error: this node lost the majority of job" in err, err
    assert "Traceback" not in err, err
    for node in nodes[1:]:
        assert "the store moved to 127.0.0.2:" in node.stderr(), node.stderr()
    print(f"store host SIGSTOP -> survivors' workers again: {took:.2f}s")


#: Worlds of 3 wait until the store has moved (the test's marker), a world of 2 waits for the
#: returning node, and the world of 3 it makes finishes.
UNTIL_BACK = """
    import json, os, time
    name = f"{os.environ['RANK']}.{os.environ['WORLD_SIZE']}.{os.getpid()}"
    with open(os.path.join(os.environ["RECORDS"], name), "w") as out:
        json.dump({"WORLD_SIZE": os.environ["WORLD_SIZE"], "pid": os.getpid()}, out)
    moved = os.path.exists(os.path.join(os.environ["RECORDS"], "..", "moved"))
    if os.environ["WORLD_SIZE"] == "2" or not moved:
        time.sleep(90)
"""


@pytest.mark.parametrize("given", ["the list", "one standby"])
def test_a_node_started_after_the_move_finds_the_store_through_the_named_hosts(
    tmp_path: Path, leaks: LeakCheck, given: str
) -> None:
    """After the host's loss, a node started with the same ``--rdzv-endpoint`` asks the named
    hosts which one serves the job and joins there (serving a standby at the free address);
    one given a single named host's address, a standby's, follows its redirect. The job grows
    back to 3 and finishes."""
    records = tmp_path / "records"
    records.mkdir()
    nodes: list[Node] = []
    try:
        nodes, rdzv, port = _nodes(tmp_path, leaks, records, body=UNTIL_BACK)
        wait_until(lambda: len(_records(records)) == 3, 60, "a world of 3")
        (tmp_path / "moved").touch()
        nodes[0].proc.send_signal(signal.SIGKILL)
        nodes[0].wait()
        wait_until(lambda: _serving("127.0.0.2", port), 30, "the store at the first standby")
        wait_until(
            lambda: any(r["WORLD_SIZE"] == "2" for r in _records(records)), 30, "a world of 2"
        )
        # `relaunch status` with the same list reads the job where the store is now.
        shown = subprocess.run(
            [
                *(sys.executable, "-m", "relaunch", "status", "--json"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv.endpoint),
                *("--rdzv-id", rdzv.run_id, "--rdzv-conf", f"token={TOKEN}"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=leaks.process_env(),
        )
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["run_id"] == rdzv.run_id
        job = script(tmp_path, UNTIL_BACK)
        env = {"RECORDS": str(records)}
        if given == "one standby":  # the third host's: it follows the store at the second
            rdzv = Rendezvous("c10d", f"127.0.0.3:{port}", lambda: True, rdzv.run_id)
        nodes.append(start(tmp_path, leaks, rdzv, "d", job, *FLAGS, env=env))
        for node in nodes[1:]:
            assert node.wait() == 0, node.stderr()
    finally:
        stop_all(nodes)
    assert "Traceback" not in nodes[3].stderr(), nodes[3].stderr()
    assert len([r for r in _records(records) if r["WORLD_SIZE"] == "3"]) == 6


def test_a_job_of_two_cannot_move_its_store_and_says_what_would(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    """No majority of two survives one's loss: the survivor ends with one line, as without a
    list, saying that 3 nodes or more would have moved the store."""
    records = tmp_path / "records"
    records.mkdir()
    nodes: list[Node] = []
    try:
        nodes, _, _ = _nodes(tmp_path, leaks, records, names="ab", body=UNTIL_BACK)
        wait_until(lambda: len(_records(records)) == 2, 60, "a world of 2")
        nodes[0].proc.send_signal(signal.SIGKILL)
        nodes[0].wait()
        assert nodes[1].wait(DETECTION + 20) == 1, nodes[1].stderr()
    finally:
        stop_all(nodes)
    err = nodes[1].stderr()
    (gone,) = [line for line in err.splitlines() if "store's host is gone" in line]
    assert gone.startswith("relaunch: error: ") and "run 3 nodes or more" in gone, err
