"""The c10d store's failover across replica groups (docs/store-failover.md, replica groups): two
groups of two nodes, four real agents on loopback (127.0.0.1-4), ``--rdzv-endpoint`` naming two
hosts. Each group alone (two members, the host one of them) could never move the store; the
job's four can: the host's node SIGKILLed, the three survivors vote, the store moves to the
standby, group 0 goes on with its surviving node, group 1 never stops, and where torchft is
installed the lighthouse moves with the store."""

from __future__ import annotations

import json
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until
from test_lighthouse import EXTENSION
from test_replica_groups_store import Node, group_node

from relaunch.endpoints import find_free_port
from relaunch.rendezvous.rounds import job_key
from relaunch.store.api import StoreError
from relaunch.store.client import TcpStore

pytestmark = pytest.mark.timeout(120)

TOKEN = "groups-failover-token"
#: A lost node is known after 1.5 s of silence; each group's first round waits for its two.
CONF = (
    "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=5,join_timeout=30,"
    f"token={TOKEN}"
)

#: Each attempt of each worker leaves a record, then runs until the test says (``finish``);
#: given a lighthouse, it then reads its status page through this node's relay (where the
#: lighthouse is now), trying for up to 10 s.
PROGRAM = """
import json, os, sys, time, urllib.request
folder = sys.argv[1]
record = {name: os.environ[name] for name in
          ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
record["pid"] = os.getpid()
with open(os.path.join(folder, "records", str(os.getpid())), "w") as out:
    json.dump(record, out)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, "finish")) and time.monotonic() < deadline:
    time.sleep(0.05)
address, deadline = os.environ.get("TORCHFT_LIGHTHOUSE"), time.monotonic() + 10
while address:
    try:
        with urllib.request.urlopen(address + "/status", timeout=2) as reply:
            print("lighthouse answered", reply.status, flush=True)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.1)
"""


def records(folder: Path) -> list[dict[str, str]]:
    found = []
    for path in (folder / "records").iterdir():
        try:
            found.append(json.loads(path.read_text()))
        except ValueError:
            continue  # being written
    return found


def serving(host: str, port: int) -> bool:
    try:
        with TcpStore(host, port, TOKEN, timeout=1, connect_timeout=0.2) as store:
            store.get("relaunch/probe")
    except StoreError:
        return False
    return True


def listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
    except OSError:
        return False
    return True


def group1_beats(port: int, run_id: str) -> int:
    """The beats of group 1's rank 0 into its running round, on the moved store."""
    group = f"{run_id}-group1"
    with TcpStore("127.0.0.2", port, TOKEN, timeout=5) as store:
        round_ = int(store.get(job_key(group, "round")).value or b"0")
        return store.get(job_key(group, "hb/0", round_)).version


def start(
    tmp_path: Path, leaks: LeakCheck, endpoints: str, run_id: str, rank: int, nnodes: str = "2:4"
) -> Node:
    rendezvous = ("--rdzv-endpoint", endpoints, "--rdzv-id", run_id, "--rdzv-conf", CONF)
    return group_node(tmp_path, leaks, rank, "--nnodes", nnodes, "--max-restarts", "2", *rendezvous)


@pytest.fixture
def four_nodes(tmp_path: Path, leaks: LeakCheck) -> Iterator[tuple[list[Node], int, str]]:
    """Node 0 hosting the store (group 0), node 1 its standby (group 0), nodes 2 and 3 group 1;
    both groups running a world of 2."""
    (tmp_path / "program.py").write_text(PROGRAM)
    (tmp_path / "records").mkdir()
    port = find_free_port("127.0.0.1")
    endpoints, run_id = f"127.0.0.1:{port},127.0.0.2:{port}", uuid.uuid4().hex[:12]
    nodes = [start(tmp_path, leaks, endpoints, run_id, 0)]
    try:
        wait_until(lambda: serving("127.0.0.1", port), 30, "node 0 to host the store")
        nodes.append(start(tmp_path, leaks, endpoints, run_id, 1))
        wait_until(lambda: listening("127.0.0.2", port), 30, "node 1 to serve the standby")
        nodes += [start(tmp_path, leaks, endpoints, run_id, rank) for rank in (2, 3)]
        wait_until(lambda: len(records(tmp_path)) == 4, 45, "both groups' worlds of 2")
        yield nodes, port, run_id
    finally:
        (tmp_path / "finish").touch()
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_the_hosts_node_killed_the_job_moves_the_store_and_both_groups_go_on(
    four_nodes: tuple[list[Node], int, str], tmp_path: Path
) -> None:
    nodes, port, run_id = four_nodes
    assert {r["WORLD_SIZE"] for r in records(tmp_path)} == {"2"}
    group1 = sorted(r["pid"] for r in records(tmp_path) if r["REPLICA_GROUP_ID"] == "1")
    killed = time.monotonic()
    nodes[0][0].send_signal(signal.SIGKILL)
    nodes[0][0].wait()
    wait_until(
        lambda: any(r["WORLD_SIZE"] == "1" for r in records(tmp_path)),
        30,
        "group 0 to go on with its surviving node",
    )
    back = time.monotonic() - killed
    # Group 1 beats into the moved store, whose fence watch counts it with group 0's node: six
    # more beats (three of the watch's windows) and the store still serves.
    beats = group1_beats(port, run_id)
    wait_until(lambda: group1_beats(port, run_id) >= beats + 6, 15, "group 1's beats")
    assert serving("127.0.0.2", port)
    (tmp_path / "finish").touch()
    for proc, err in nodes[1:]:
        assert proc.wait(30) == 0, err.read_text()
        said = err.read_text()
        assert "the store moved to 127.0.0.2:" in said, said
        reforms = "the job re-forms" if proc is nodes[1][0] else "this replica group goes on"
        assert reforms in said, said
        assert "Traceback" not in said, said
    # Group 1 never stopped: the same two workers from start to end, none restarted.
    assert sorted(r["pid"] for r in records(tmp_path) if r["REPLICA_GROUP_ID"] == "1") == group1
    if EXTENSION is not None:  # the lighthouse moved with the store, to node 1
        said = nodes[1][1].read_text()
        assert "torchft's lighthouse for the job runs on this node: http://127.0.0.2:" in said
        for rank in (1, 2, 3):  # and every surviving node's workers reach it through its relay
            answered = (tmp_path / f"node{rank}.out").read_text()
            assert "lighthouse answered 200" in answered, answered
    print(f"the host's node SIGKILLed -> group 0 running again on its survivor: {back:.2f}s")


def test_two_groups_of_one_node_cannot_move_it_and_say_what_would(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    """No majority of the job's two members survives the host's loss: the other group ends with
    one line, saying what would have moved the store."""
    (tmp_path / "program.py").write_text(PROGRAM)
    (tmp_path / "records").mkdir()
    port = find_free_port("127.0.0.1")
    endpoints, run_id = f"127.0.0.1:{port},127.0.0.2:{port}", uuid.uuid4().hex[:12]
    nodes = [start(tmp_path, leaks, endpoints, run_id, 0, "2")]
    try:
        wait_until(lambda: serving("127.0.0.1", port), 30, "node 0 to host the store")
        nodes.append(start(tmp_path, leaks, endpoints, run_id, 1, "2"))
        wait_until(lambda: len(records(tmp_path)) == 2, 60, "both groups' workers")
        nodes[0][0].send_signal(signal.SIGKILL)
        nodes[0][0].wait()
        assert nodes[1][0].wait(30) == 1, nodes[1][1].read_text()
    finally:
        (tmp_path / "finish").touch()
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    said = nodes[1][1].read_text()
    (gone,) = [line for line in said.splitlines() if "store's host is gone" in line]
    assert "run 3 nodes or more in all the replica groups" in gone, said
