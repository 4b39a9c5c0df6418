"""The test side of the jobs tests/compat/test_compat_agent_recipe.py and ..._roles.py run:
nodes started as processes of their own (``compat_ranks_fns.py``), and torch 2.13's rule for
the rank variables their workers must see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import LeakCheck

HERE = os.path.dirname(os.path.abspath(__file__))
FNS = os.path.join(HERE, "compat_ranks_fns.py")
#: The round completes a second after its first node if the others do not come: torch's
#: default last call (30 s) is only waited for on one node of min 1, max 2.
FAST = {"last_call_timeout": 1, "join_timeout": 60}

Node = tuple[str, int]  # (role, workers)
Table = dict[tuple[int, int], dict[str, str]]  # (group rank, local rank) -> rank variables


def run_nodes(tasks: Sequence[dict[str, Any]], leaks: LeakCheck, timeout: float) -> list[Any]:
    """Run each task as a node in a process of its own, all at once; each node's outcome."""
    env = leaks.process_env(PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, FNS, json.dumps(task)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for task in tasks
    ]
    deadline = time.monotonic() + timeout
    outcomes = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = out.strip().splitlines()
            if not lines:
                pytest.fail(f"a node printed nothing (exit {proc.returncode}): {err[-2000:]}")
            outcome = json.loads(lines[-1])
            if "error" in outcome:
                pytest.fail(f"a node failed: {outcome['error']}\n{err[-2000:]}")
            outcomes.append(outcome["workers"])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # ours, by pid; its workers carry the leak mark
                proc.wait()
    return outcomes


def tasks_for(
    kind: str, backend: str, endpoint: str, nodes: Sequence[Node], min_nodes: int, max_nodes: int
) -> list[dict[str, Any]]:
    run_id = f"{kind}-{uuid.uuid4().hex[:8]}"
    return [
        {
            "kind": kind,
            "backend": backend,
            "endpoint": endpoint,
            "run_id": run_id,
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "role": role,
            "local_world_size": workers,
            "conf": dict(FAST),
        }
        for role, workers in nodes
    ]


def table_of(outcomes: Sequence[dict[str, dict[str, str]]]) -> Table:
    """Every worker's variables, keyed by its node's group rank and its local rank."""
    return {
        (int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])): env
        for workers in outcomes
        for env in workers.values()
    }


def torch_rule(nodes: Sequence[Node]) -> Table:
    """What torch 2.13's agent gives the workers of ``nodes`` (in group-rank order), worked
    out here from its documented rule: global ranks contiguous per node in group-rank order,
    role ranks the same within each role."""
    world = sum(workers for _, workers in nodes)
    table: Table = {}
    before = 0
    for group_rank, (role, workers) in enumerate(nodes):
        role_before = sum(w for r, w in nodes[:group_rank] if r == role)
        for local in range(workers):
            table[(group_rank, local)] = {
                "LOCAL_RANK": str(local),
                "RANK": str(before + local),
                "GROUP_RANK": str(group_rank),
                "ROLE_RANK": str(role_before + local),
                "ROLE_NAME": role,
                "LOCAL_WORLD_SIZE": str(workers),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": str(len(nodes)),
                "ROLE_WORLD_SIZE": str(sum(w for r, w in nodes if r == role)),
            }
        before += workers
    return table


def check_rule(outcomes: Sequence[dict[str, dict[str, str]]], nodes: Sequence[Node]) -> Table:
    """The workers' variables are torch's rule for the group ranks the nodes got: each
    node's group rank read from its first worker, its (role, workers) from the task list."""
    order: list[Node] = [("", 0)] * len(nodes)
    for workers, node in zip(outcomes, nodes, strict=True):
        assert len(workers) == node[1]
        order[int(next(iter(workers.values()))["GROUP_RANK"])] = node
    table = table_of(outcomes)
    assert table == torch_rule(order)
    return table
