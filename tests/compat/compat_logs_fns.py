"""Workers, a user's own ``LogsSpecs`` and one node's agent for tests/compat/test_compat_logs.py.

Run as a script (``python compat_logs_fns.py '<json>'``) it runs one node, through torch or
through relaunch: a c10d rendezvous of one node, ``LocalElasticAgent(spec, logs_specs,
log_line_prefix_template=...)`` over a binary worker that prints to both streams, and prints
its console as the workers' lines, then one JSON line (the run's result, or the error).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from relaunch.core.workers.logs_dest import LogsDest
from relaunch.core.workers.logs_specs import LogsSpecs


def print_lines(tag: str) -> str:
    """A function worker: a line on each stream, its tag and rank; returns the tag."""
    rank = os.environ.get("LOCAL_RANK", "?")
    print(f"out {tag} {rank}", flush=True)
    print(f"err {tag} {rank}", file=sys.stderr, flush=True)
    return tag


class CustomLogsSpecs(LogsSpecs):
    """A user's own layout: ``{root}/{attempt}/rank{r}.out`` for every stdout (rank 0's also
    shown on the console), ``rank0.err`` for rank 0's stderr (the others' on the console), and
    the error files in ``{root}/{attempt}/errors/``. Written against relaunch's ``LogsSpecs``;
    torch takes it as it is (it only calls ``reify``)."""

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        attempt = envs[0].get("TORCHELASTIC_RESTART_COUNT", "0") if envs else "0"
        base = os.path.join(self.root_log_dir, attempt)
        os.makedirs(os.path.join(base, "errors"), exist_ok=True)
        dest = LogsDest()
        for rank in envs:
            dest.stdouts[rank] = os.path.join(base, f"rank{rank}.out")
            dest.stderrs[rank] = os.path.join(base, "rank0.err") if rank == 0 else ""
            dest.error_files[rank] = os.path.join(base, "errors", f"{rank}.json")
            envs[rank]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[rank]
        dest.tee_stdouts[0] = dest.stdouts[0]
        return dest


def run_node(task: dict[str, Any]) -> dict[str, Any]:
    """One node as ``task`` says: torch's or relaunch's agent, with ``logs_specs`` (the
    default one of ``log_dir``, ``redirects`` and ``tee``, or ``CustomLogsSpecs``) and the
    prefix template; the run's state and return values."""
    if task["kind"] == "torch":
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    else:
        from relaunch.agent import LocalElasticAgent, WorkerSpec  # type: ignore[assignment]
        from relaunch.procs import DefaultLogsSpecs, Std  # type: ignore[assignment]
        from relaunch.rendezvous import (  # type: ignore[assignment]
            RendezvousParameters,
            get_rendezvous_handler,
        )
    handler = get_rendezvous_handler(
        RendezvousParameters("c10d", task["endpoint"], task["run_id"], 1, 1)
    )
    spec = WorkerSpec(
        role=task["role"],
        local_world_size=task["nproc"],
        rdzv_handler=handler,
        entrypoint=sys.executable,
        args=("-u", task["script"], "${local_rank}"),
        max_restarts=0,
        monitor_interval=0.1,
        duplicate_stdout_filters=task["filters"],
    )
    if task["custom"]:
        logs_specs: Any = CustomLogsSpecs(task["log_dir"])
    else:
        logs_specs = DefaultLogsSpecs(task["log_dir"], Std(task["redirects"]), Std(task["tee"]))
    agent = LocalElasticAgent(
        spec, logs_specs, "spawn", 60, log_line_prefix_template=task["template"]
    )
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    return {"failed": result.is_failed(), "returns": sorted(result.return_values)}


if __name__ == "__main__":
    try:
        outcome = run_node(json.loads(sys.argv[1]))
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.flush()
    print(json.dumps(outcome), flush=True)
