"""Group ranks where the scheduler put the nodes, and where they were
(``core.rendezvous.node_order``): real agents on the built-in store and on a real etcd member."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until
from test_rendezvous import FAST, Rendezvous, rendezvous_for, script
from test_spares_and_health import Node, start, stop_all

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["c10d", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> Rendezvous:
    return rendezvous_for(request)


#: Each worker says its node (the test's NODE), group rank and global rank once it reached
#: MASTER_ADDR:MASTER_PORT, where the agent of group rank 0 serves torch's store: the master the
#: record names is where group rank 0 serves it. Then the workers wait for the GO file.
MEET_AT_THE_MASTER = """
    import os, socket, time
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    master = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(master, timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print("node", env["NODE"], "group", env["GROUP_RANK"], "rank", rank, "world", world,
          flush=True)
    while not os.path.exists(env["GO_FILE"]):
        time.sleep(0.01)
"""


def places(nodes: dict[str, Node]) -> dict[str, list[tuple[str, str, str]]]:
    """Each node's lines, as (group rank, global rank, world size)."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for name, node in nodes.items():
        for line in node.stdout():
            _, _, _, group, _, rank, _, world = line.split()
            found.setdefault(name, []).append((group, rank, world))
    return found


def test_group_ranks_follow_node_ranks_whatever_the_arrival_order(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """Started in reverse (node rank 2 first: on c10d it hosts the store and takes the first
    ticket), the nodes still get group ranks 0, 1, 2 by --node-rank; node rank 1 runs two
    workers, so global ranks show the order too."""
    job = script(tmp_path, MEET_AT_THE_MASTER)
    flags = ("--nnodes", "3", "--rdzv-conf", FAST)
    nodes: dict[str, Node] = {}
    try:
        for rank in (2, 1, 0):
            nproc = "2" if rank == 1 else "1"
            node = start(
                tmp_path,
                leaks,
                rdzv,
                f"n{rank}",
                job,
                *flags,
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                nproc,
                env={"NODE": str(rank)},
            )
            nodes[str(rank)] = node
            if rank == 2:
                wait_until(rdzv.ready, what="the first agent to host the store")
        wait_until(lambda: sum(len(n.stdout()) for n in nodes.values()) == 4, 60, "4 workers")
        (tmp_path / "go").touch()
        assert [node.wait() for node in nodes.values()] == [0, 0, 0]
    finally:
        stop_all(list(nodes.values()))
    got = {name: sorted(lines) for name, lines in places(nodes).items()}
    assert got == {
        "0": [("0", "0", "4")],
        "1": [("1", "1", "4"), ("1", "2", "4")],
        "2": [("2", "3", "4")],
    }


def test_survivors_keep_their_group_ranks_and_the_spare_takes_the_lost_one(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """Three members and a spare; the member of group rank 1 is killed. The spare waited in
    the next round before anyone, yet the survivors keep ranks 0 and 2 and it takes rank 1."""
    job = script(tmp_path, MEET_AT_THE_MASTER)
    flags = ("--nnodes", "3:3", "--rdzv-conf", FAST)
    nodes: dict[str, Node] = {}
    try:
        for name in ("a", "b", "c"):
            nodes[name] = start(tmp_path, leaks, rdzv, name, job, *flags, env={"NODE": name})
            if name == "a":
                wait_until(rdzv.ready, what="the first agent to host the store")
        wait_until(lambda: all(n.stdout() for n in nodes.values()), 60, "a world of 3")
        first = {name: lines[0][0] for name, lines in places(nodes).items()}
        assert sorted(first.values()) == ["0", "1", "2"]
        spare = nodes["spare"] = start(
            tmp_path, leaks, rdzv, "spare", job, *flags, env={"NODE": "spare"}
        )
        wait_until(lambda: "waiting as a spare" in spare.stderr(), 60, "the spare to wait")
        lost = next(name for name, group in first.items() if group == "1")
        if rdzv.backend == "c10d":
            assert lost != "a", "the store's host is group rank 0 here"
        nodes[lost].proc.send_signal(signal.SIGKILL)
        nodes[lost].wait()
        survivors = [name for name in ("a", "b", "c") if name != lost]
        wait_until(
            lambda: all(len(nodes[name].stdout()) == 2 for name in survivors) and spare.stdout(),
            60,
            "the re-formed world",
        )
        (tmp_path / "go").touch()
        assert [nodes[name].wait() for name in (*survivors, "spare")] == [0, 0, 0]
    finally:
        stop_all(list(nodes.values()))
    after = {name: lines[-1][0] for name, lines in places(nodes).items() if name != lost}
    assert after == {**{name: first[name] for name in survivors}, "spare": "1"}
