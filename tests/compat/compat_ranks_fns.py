"""One node of a job, built torch's documented way, through torch or through relaunch.

Run as a script by tests/compat/test_compat_agent_recipe.py and ..._roles.py: ``python
compat_ranks_fns.py '<json>'`` builds a rendezvous handler (``get_rendezvous_handler`` from
``RendezvousParameters``, or ``FixedRankHandler``: a user's own handler written for torch) and a
``LocalElasticAgent(WorkerSpec(role, local_world_size, ...))``, runs it, and prints one JSON line:
each worker's rank variables by global rank, or the error. The workers run ``rank_env``, which
must be importable: the node's environment puts this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

#: The variables a worker's place in the job is told by.
RANK_VARS = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
)


def rank_env() -> dict[str, str]:
    """A worker: its rank variables."""
    return {name: os.environ.get(name, "<unset>") for name in RANK_VARS}


def fixed_rank_handler(kind: str, run_id: str, rank: int, nodes: int, store_port: int) -> Any:
    """A handler written for torch (torch's classes, as a user writes it), whatever ``kind``
    of agent drives it: node ``rank`` of ``nodes``, its control-plane store the torch
    ``TCPStore`` the test hosts at ``store_port`` (a fresh prefix per run), and torch's
    ``RendezvousInfo`` for an answer."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class FixedRankHandler(RendezvousHandler):
        def __init__(self) -> None:
            client = TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
            self._store = PrefixStore(f"{kind}/{run_id}", client)
            self._closed = False

        def get_backend(self) -> str:
            return "fixed"

        def next_rendezvous(self) -> RendezvousInfo:
            # The workers' own store: group rank 0 publishes a free port, as torch's do.
            master = RendezvousStoreInfo.build(rank, self._store, "127.0.0.1")
            return RendezvousInfo(self._store, rank, nodes, master)

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return run_id

        def shutdown(self) -> bool:
            return True

    return FixedRankHandler()


def run_node(task: dict[str, Any]) -> dict[str, Any]:
    """Run one node as ``task`` says; its workers' rank variables by global rank."""
    kind = task["kind"]
    if kind == "torch":
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    else:
        from relaunch.agent import LocalElasticAgent, WorkerSpec  # type: ignore[assignment]
        from relaunch.rendezvous import (  # type: ignore[assignment]
            RendezvousParameters,
            get_rendezvous_handler,
        )
    if task["backend"] == "fixed":
        handler = fixed_rank_handler(
            kind, task["run_id"], task["rank"], task["max_nodes"], task["store_port"]
        )
    else:
        params = RendezvousParameters(
            backend=task["backend"],
            endpoint=task["endpoint"],
            run_id=task["run_id"],
            min_nodes=task["min_nodes"],
            max_nodes=task["max_nodes"],
            **task.get("conf", {}),
        )
        handler = get_rendezvous_handler(params)
    spec = WorkerSpec(
        role=task["role"],
        local_world_size=task["local_world_size"],
        rdzv_handler=handler,
        entrypoint=rank_env,
        args=(),
        max_restarts=0,
        monitor_interval=0.1,
    )
    log_dir = tempfile.mkdtemp(prefix=f"compat-{kind}-")
    if kind == "torch":
        # Forked, torch's workers import no torch of their own; the variables are the same.
        agent: Any = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=log_dir), "fork", 60)
    else:
        agent = LocalElasticAgent(spec, "spawn", 60, log_dir=log_dir)
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    if result.is_failed():
        return {"error": f"{result.state}: {result.failures}"}
    return {"workers": {str(rank): env for rank, env in result.return_values.items()}}


if __name__ == "__main__":
    try:
        outcome = run_node(json.loads(sys.argv[1]))
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(outcome), flush=True)
