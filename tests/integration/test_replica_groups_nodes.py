"""torchft's replica groups on several nodes (issue 46): two relaunch agents over loopback, one
replica group each (``--nnodes 2 --replica-groups 2 --node-rank 0|1``), on the built-in store
and on a real etcd. One node runs torchft's lighthouse beside the store (c10d: the store's
host; etcd: the holder of the job key's lease), every node's workers reach it through their
node's relay. The real library (torchft 0.2.0, CPU, gloo) and the training program of
``python -m benchmarks replicas``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until
from etcd_cluster import EtcdCluster
from test_replica_groups_torchft import PROGRAM

from relaunch.endpoints import find_free_port
from relaunch.store.etcd import EtcdStore
from tests.support.ft_lines import Line, parse

#: torchft's tests keep both cores busy: they run one after another, in one xdist group of
#: their own (beside the torch group: one group of both made the suite 11 min).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(150), pytest.mark.xdist_group("torchft")]

STEPS, KILL_STEP = 30, 10
#: A lost node is known within 1.5 s; an etcd lease lasts 2 s (whole seconds).
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=3,join_timeout=60"


@dataclass
class Node:
    """One node's agent, its output in files."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def lines(self) -> list[Line]:
        return parse(self.out.read_text())

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float = 90) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the agent did not end within {timeout:g}s; its stderr:\n{self.stderr()[-3000:]}"
            ) from None


@dataclass
class Job:
    backend: str
    endpoint: str
    run_id: str
    etcd: EtcdCluster | None = None

    def lighthouse_key(self) -> str:
        return f"relaunch/{self.run_id}/lighthouse"

    def announced(self) -> bytes | None:
        """What the job's store says of the lighthouse now (etcd only: c10d's store is the
        host agent's)."""
        assert self.etcd is not None
        store = EtcdStore(self.etcd.endpoints)
        try:
            return store.get(self.lighthouse_key()).value
        finally:
            store.close()


@pytest.fixture
def job(request: pytest.FixtureRequest) -> Job:
    """A job on the backend the test names (``indirect`` parametrization)."""
    run_id = uuid.uuid4().hex[:12]
    if request.param == "etcd":
        etcd = request.getfixturevalue("etcd_shared")
        return Job("etcd", etcd.endpoints, run_id, etcd)
    return Job("c10d", f"127.0.0.1:{find_free_port('127.0.0.1')}", run_id)


def start(
    tmp_path: Path, leaks: LeakCheck, job: Job, rank: int, *program_args: str, steps: int = STEPS
) -> Node:
    out, err = tmp_path / f"node{rank}.out", tmp_path / f"node{rank}.err"
    argv = [
        *(sys.executable, "-m", "relaunch", "--nnodes", "2", "--replica-groups", "2"),
        *("--node-rank", str(rank), "--nproc-per-node", "1", "--max-restarts", "2"),
        *("--rdzv-backend", job.backend, "--rdzv-endpoint", job.endpoint),
        *("--rdzv-id", job.run_id, "--rdzv-conf", CONF, "--local-addr", f"127.0.0.{rank + 1}"),
        *("--log-dir", str(tmp_path / f"logs{rank}")),
        *(PROGRAM, "--steps", str(steps), "--pace", "0.02", *program_args),
    ]
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=leaks.process_env()
        )
    return Node(proc, out, err)


def start_both(tmp_path: Path, leaks: LeakCheck, job: Job, *program_args: str, steps: int = STEPS):
    """Node 0 first, until it runs the lighthouse (c10d: it hosts the store; etcd: it holds
    the key's lease), then node 1."""
    first = start(tmp_path, leaks, job, 0, *program_args, steps=steps)
    wait_until(
        lambda: (
            "torchft's lighthouse for the job runs on this node" in first.stderr()
            or first.proc.poll() is not None
        ),
        60,
        "node 0 to run the lighthouse",
    )
    assert first.proc.poll() is None, first.stderr()
    return [first, start(tmp_path, leaks, job, 1, *program_args, steps=steps)]


def stop_all(nodes: list[Node]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.kill()
        node.proc.wait()


def of(lines: list[Line], kind: str) -> list[Line]:
    return [line for line in lines if line.kind == kind]


# Each backend runs a job of two nodes (a worker killed on etcd, a node killed on c10d): the
# four pairs took 120 s of the suite's torch group, one after another.
@pytest.mark.parametrize("job", ["etcd"], indirect=True)
def test_a_worker_killed_in_one_group_heals_while_the_other_goes_on(
    tmp_path: Path, leaks: LeakCheck, job: Job
) -> None:
    nodes = start_both(tmp_path, leaks, job, "--kill-group", "1", "--kill-step", str(KILL_STEP))
    try:
        statuses = [node.wait() for node in nodes]
    finally:
        stop_all(nodes)
    said = [node.stderr() for node in nodes]
    assert statuses[0] == 0, said[0][-3000:]
    if job.backend == "etcd":
        assert statuses[1] == 0, said[1][-3000:]
    # Node 0 runs the lighthouse; each node's workers reach it through a relay of their own.
    assert "torchft's lighthouse for the job runs on this node: http://127.0.0.1:" in said[0]
    if job.backend == "c10d":
        assert "torchft's lighthouse for the job runs" not in said[1]
    # (etcd: node 0, ending first, gives its lease back; node 1 may take the key then.)
    for text in said:
        assert "this node's workers reach it through http://127.0.0.1:" in text, text
    group0, group1 = (node.lines() for node in nodes)
    (kill,) = of(group1, "kill")
    assert kill.step == KILL_STEP
    # Group 0 never restarted and stepped on after the kill, in order.
    assert [line.fields["attempt"] for line in of(group0, "start")] == ["0"]
    steps0 = [line.step for line in of(group0, "step")]
    assert steps0 == sorted(steps0) and any(line.at > kill.at for line in of(group0, "step"))
    # Group 1 restarted once and healed from group 0: its first step back is past the kill.
    assert [line.fields["attempt"] for line in of(group1, "start")] == ["0", "1"]
    back = [line.step for line in of(group1, "step") if line.at > kill.at]
    assert back and back[0] > KILL_STEP
    ends = {(done.step, done.fields["sha256"]) for done in of(group0 + group1, "done")}
    assert len(of(group0 + group1, "done")) == 2 and len(ends) == 1, ends


@pytest.mark.parametrize("job", ["c10d"], indirect=True)
def test_the_other_groups_node_killed_the_first_group_goes_on_to_the_end(
    tmp_path: Path, leaks: LeakCheck, job: Job
) -> None:
    steps = 20  # alone, group 0 trains to 10x this (the program's bound on a lone group)
    nodes = start_both(tmp_path, leaks, job, steps=steps)
    try:
        wait_until(
            lambda: any(line.step >= KILL_STEP for line in of(nodes[1].lines(), "step")),
            60,
            f"group 1 at step {KILL_STEP}",
        )
        nodes[1].proc.send_signal(signal.SIGKILL)
        nodes[1].proc.wait()
        status = nodes[0].wait(120)
    finally:
        stop_all(nodes)
    said = nodes[0].stderr()
    assert status == 0, said[-3000:]
    group0 = nodes[0].lines()
    attempts = [line.fields["attempt"] for line in of(group0, "start")]
    # A node killed mid-allreduce crashes torchft 0.2.0's DDP hook on the survivor (its
    # ``assert fut._fut`` after the failed allreduce): group 0 restarts then, once, on its own.
    assert attempts == ["0"] or (attempts == ["0", "1"] and "assert fut._fut" in said), said
    (done,) = of(group0, "done")
    assert done.step >= steps


def test_etcd_the_lighthouses_node_killed_another_takes_its_lease(
    tmp_path: Path, leaks: LeakCheck, etcd_shared: EtcdCluster
) -> None:
    """etcd: the node holding the key's lease (node 0) is SIGKILLed; its lease lapses, node 1
    takes the key, runs the lighthouse on its own address, and its group trains on."""
    job = Job("etcd", etcd_shared.endpoints, uuid.uuid4().hex[:12], etcd_shared)
    nodes = start_both(tmp_path, leaks, job, steps=20)
    try:
        wait_until(
            lambda: any(line.step >= KILL_STEP for line in of(nodes[1].lines(), "step")),
            60,
            f"group 1 at step {KILL_STEP}",
        )
        assert (job.announced() or b"").startswith(b"127.0.0.1:")
        nodes[0].proc.send_signal(signal.SIGKILL)
        nodes[0].proc.wait()
        wait_until(
            lambda: (job.announced() or b"").startswith(b"127.0.0.2:"),
            30,
            "node 1 to run the lighthouse",
        )
        status = nodes[1].wait(120)
    finally:
        stop_all(nodes)
    said = nodes[1].stderr()
    assert status == 0, said[-3000:]
    assert "torchft's lighthouse for the job runs on this node: http://127.0.0.2:" in said
    (done,) = of(nodes[1].lines(), "done")
    assert done.step >= 20
    assert os.path.exists(tmp_path / "logs1" / "lighthouse.log")
