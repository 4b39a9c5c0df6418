"""torch's documented recipe for an agent, through relaunch beside torch: a handler from
``get_rendezvous_handler(RendezvousParameters(backend, endpoint, run_id, min_nodes,
max_nodes))`` and ``LocalElasticAgent(WorkerSpec(role, local_world_size=2, ...)).run()``.

The join carries the node's worker count from its ``WorkerSpec`` (nodes may differ), not from
the rendezvous parameters: one node of two workers, two such nodes, and nodes of different
worker counts, each node an agent in a process of its own on loopback. Every worker's rank
variables must be torch 2.13's rule (global ranks contiguous per node in group-rank order) and
equal to what torch's own ``LocalElasticAgent`` gives for the same recipe where the group ranks
are the same.
"""

from __future__ import annotations

import sys

import pytest
from compat_ranks_nodes import check_rule, run_nodes, tasks_for

from relaunch.agent import LocalElasticAgent, WorkerSpec
from relaunch.endpoints import find_free_port
from relaunch.rendezvous import RendezvousParameters, get_rendezvous_handler

#: Every test here runs torch's agent beside relaunch's, or in the same process as torch.
pytestmark = pytest.mark.xdist_group("torch")
torch_agent = pytest.importorskip("torch.distributed.elastic.agent.server.local_elastic_agent")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_the_recipe_runs_two_workers_on_one_node_as_torch_does(backend, leaks) -> None:
    port = find_free_port()
    nodes = [("trainer", 2)]
    tables = {}
    for kind in ("torch", "relaunch"):
        tasks = tasks_for(kind, backend, f"127.0.0.1:{port}", nodes, 1, 2)
        if backend == "static":
            for task in tasks:
                task.update(max_nodes=1, conf={"rank": 0})
        tables[kind] = check_rule(run_nodes(tasks, leaks, 180), nodes)
    assert tables["relaunch"] == tables["torch"]
    assert tables["relaunch"][(0, 1)]["WORLD_SIZE"] == "2"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "nodes", [[("trainer", 2), ("trainer", 2)], [("trainer", 1), ("trainer", 3)]], ids=str
)
def test_two_nodes_of_the_recipe_form_one_world_as_torch_does(nodes, leaks) -> None:
    """Two agents, two processes: WORLD_SIZE counts every node's workers, whatever each runs."""
    for kind in ("torch", "relaunch"):
        port = find_free_port()
        outcomes = run_nodes(tasks_for(kind, "c10d", f"127.0.0.1:{port}", nodes, 2, 2), leaks, 240)
        table = check_rule(outcomes, nodes)
        assert {env["WORLD_SIZE"] for env in table.values()} == {str(sum(w for _, w in nodes))}


@pytest.mark.timeout(120)
def test_two_nodes_of_different_worker_counts_on_etcd(etcd, leaks) -> None:
    """The same on etcd, where each node's join key carries its worker count (torch's etcd
    backends speak etcd's v2 API, so relaunch runs alone here)."""
    nodes = [("trainer", 3), ("trainer", 1)]
    tasks = tasks_for("relaunch", "etcd", etcd.endpoints, nodes, 2, 2)
    check_rule(run_nodes(tasks, leaks, 100), nodes)


@pytest.mark.timeout(60)
def test_the_recipe_in_this_process_gives_every_rank(tmp_path) -> None:
    """The recipe's objects as torch's docs build them, in this process: the handler learns
    the worker count from the agent (the rendezvous parameters carry none)."""
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{find_free_port()}",
        run_id="recipe",
        min_nodes=1,
        max_nodes=2,
        last_call_timeout=0.2,
    )
    handler = get_rendezvous_handler(params)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=3,
        rdzv_handler=handler,
        entrypoint=sys.executable,
        args=("-c", "pass"),
        max_restarts=0,
    )
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path))
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    assert not result.is_failed()
    workers = agent.get_worker_group().workers
    assert [(w.global_rank, w.world_size, w.role_rank, w.role_world_size) for w in workers] == [
        (0, 3, 0, 3),
        (1, 3, 1, 3),
        (2, 3, 2, 3),
    ]
