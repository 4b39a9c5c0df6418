"""The job's c10d store outlives the group of the node that hosts it (replica groups on several
nodes): two relaunch agents over loopback, one group each, the store's host's group ends first
and the other group, still running, finishes with exit status 0; where torchft is installed the
lighthouse beside the store serves it to the end too. And ``store.attendance``, what the host
waits on, on a real server: the last connection's end, or its peers' silence."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until
from test_lighthouse import EXTENSION

from relaunch.endpoints import find_free_port
from relaunch.store.client import TcpStore
from relaunch.store.server import TcpStoreServer

pytestmark = pytest.mark.timeout(60)

#: A lost node is known within 1.5 s: the host's wait for silent peers too.
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=3,join_timeout=30"
WAITING = "this node hosts the job's store, which the other replica groups' agents still use"

#: Group 0 ends as soon as group 1 runs; group 1 ends when the test says (the file ``go``),
#: first reading the lighthouse's status page through its relay where it was given one.
PROGRAM = """
import os, sys, time, urllib.request
folder, group = sys.argv[1], int(os.environ["REPLICA_GROUP_ID"])

def wait_for(name):
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            sys.exit(f"no {name} within 30 s")
        time.sleep(0.02)

if group == 0:
    wait_for("running1")
else:
    open(os.path.join(folder, "running1"), "w").close()
    wait_for("go")
    address = os.environ.get("TORCHFT_LIGHTHOUSE")
    if address:
        with urllib.request.urlopen(address + "/status", timeout=10) as reply:
            print("lighthouse answered", reply.status, flush=True)
print(f"group {group} done", flush=True)
"""


Node = tuple["subprocess.Popen[bytes]", Path]


def start(tmp_path: Path, leaks: LeakCheck, endpoint: str, run_id: str, rank: int) -> Node:
    """Node ``rank``'s agent (group ``rank``); node 1 never hosts the store."""
    conf = CONF if rank == 0 else f"{CONF},is_host=false"
    rendezvous = ("--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf)
    return group_node(tmp_path, leaks, rank, "--nnodes", "2", *rendezvous)


def group_node(tmp_path: Path, leaks: LeakCheck, rank: int, *options: str) -> Node:
    """Node ``rank``'s agent of a job of 2 replica groups on c10d, at 127.0.0.(rank + 1), with
    ``options`` (its nodes, rendezvous), running ``program.py``; its output in files."""
    argv = [
        *(sys.executable, "-m", "relaunch", "--replica-groups", "2", "--rdzv-backend", "c10d"),
        *("--node-rank", str(rank), "--nproc-per-node", "1", *options),
        *("--local-addr", f"127.0.0.{rank + 1}", "--log-dir", str(tmp_path / f"logs{rank}")),
        *(str(tmp_path / "program.py"), str(tmp_path)),
    ]
    err = tmp_path / f"node{rank}.err"
    with open(tmp_path / f"node{rank}.out", "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=leaks.process_env()
        )
    return proc, err


@pytest.fixture
def two_nodes(tmp_path: Path, leaks: LeakCheck) -> Iterator[list[Node]]:
    """Both nodes started, group 0's run over and its host waiting for group 1's agent."""
    (tmp_path / "program.py").write_text(PROGRAM)
    endpoint = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    run_id = uuid.uuid4().hex[:12]
    nodes = [start(tmp_path, leaks, endpoint, run_id, rank) for rank in (0, 1)]
    try:
        host, host_err = nodes[0]
        wait_until(
            lambda: WAITING in host_err.read_text() or host.poll() is not None,
            30,
            "the store's host to say it waits for the other group",
        )
        assert host.poll() is None, host_err.read_text()
        yield nodes
    finally:
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_the_stores_host_serves_the_other_group_to_its_end(
    two_nodes: list[Node], tmp_path: Path
) -> None:
    (host, host_err), (other, other_err) = two_nodes
    (tmp_path / "go").touch()
    assert other.wait(30) == 0, other_err.read_text()
    ended = time.monotonic()
    assert host.wait(10) == 0, host_err.read_text()
    after = time.monotonic() - ended
    assert after < 3.0, f"the host ended {after:.2f}s after the last group"
    said = host_err.read_text()
    assert "relaunch: group 0: run summary: succeeded" in said
    assert "relaunch: group 0: the job's store ends: the other agents left (after " in said
    assert "store's host is gone" not in other_err.read_text()
    assert "group 1 done" in (tmp_path / "node1.out").read_text()
    if EXTENSION is not None:  # torchft's lighthouse, beside the store, outlived group 0 too
        assert "lighthouse answered 200" in (tmp_path / "node1.out").read_text()


def test_a_stop_signal_ends_the_hosts_wait_at_once(two_nodes: list[Node]) -> None:
    (host, host_err), _ = two_nodes
    host.send_signal(signal.SIGTERM)
    assert host.wait(10) == 128 + signal.SIGTERM
    assert "relaunch: group 0: stopped by SIGTERM: the job's store ends now" in host_err.read_text()


def test_attendance_ends_with_the_last_connection_or_with_silence() -> None:
    server = TcpStoreServer("127.0.0.1", 0).start()
    try:
        first, second = (TcpStore("127.0.0.1", server.port) for _ in range(2))
        first.set("key", b"1")
        assert server.attendance.connected() == 2
        first.close()
        start = time.monotonic()
        assert server.attendance.wait_gone(0.2) is False  # the second one never speaks
        assert 0.2 <= time.monotonic() - start < 2.0
        second.set("key", b"2")
        closer = threading.Timer(0.1, second.close)
        closer.start()
        assert server.attendance.wait_gone(30) is True  # woken by the end, not the deadline
        closer.join()
    finally:
        server.stop()
