"""The Slurm environment, for ``core.schedulers.detect``: detect(environ) -> Inference | None.

``srun -N4 --ntasks-per-node=1 relaunch train.py`` starts one relaunch per node, each a task of
the job step, with the step described in its environment. From it relaunch infers:

- ``--nnodes``: the step's nodes, ``SLURM_STEP_NUM_NODES`` (the step's, not the job's: srun may
  run on part of the allocation); ``--node-rank``: ``SLURM_NODEID``. With several tasks on a
  node, each task is a relaunch agent of its own: ``--nnodes`` is the step's tasks
  (``SLURM_STEP_NUM_TASKS``) and ``--node-rank`` ``SLURM_PROCID``, and ``--nproc-per-node`` is
  not inferred.
- ``--rdzv-backend c10d`` and ``--rdzv-endpoint`` on the first host of the step's node list
  (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``; hostlist expressions such as
  ``gpu[01-04,07],cpu3`` are expanded here), whose agent can bind it and so hosts the store. The
  name is Slurm's node name, resolved by every node; where ``SLURM_NODE_ALIASES`` gives that node
  an address (cloud and dynamic nodes), the address. The port is ``29400 + (10 * job id + step
  id) % 1000``, so that jobs (and steps) sharing a first node rarely meet on one port.
  ``MASTER_ADDR`` and ``MASTER_PORT``, where set, name the host and port instead.
- ``--rdzv-id``: ``<job id>.<step id>`` (``SLURM_JOB_ID``, ``SLURM_STEP_ID``).
- ``--nproc-per-node``: the GPUs Slurm gave the node (``SLURM_GPUS_ON_NODE``, else the indices
  in ``SLURM_STEP_GPUS`` or ``SLURM_JOB_GPUS``), one worker per GPU; nothing without GPUs.
- ``--signals-to-handle``: the default ones and ``SIGUSR1``, the warning ``sbatch
  --signal=USR1@90`` sends every process of the job's steps before the time limit: like the
  first SIGTERM, it asks the workers to stop (``relaunch.stop_requested()``).

Nothing is inferred outside a job step (a batch script or ``salloc`` shell, where relaunch runs
on one node, or ``srun`` with no step id).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from typing import Any

from relaunch.core.schedulers.inference import Inference

#: The lowest port of the built-in store on the step's first node (torchrun's c10d default).
STORE_PORT = 29400
#: Ports ``STORE_PORT`` to ``STORE_PORT + PORT_SPAN - 1`` are used.
PORT_SPAN = 1000
#: The default ``--signals-to-handle`` and Slurm's warning signal.
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1]
#: Step ids from here on are Slurm's special steps (batch, extern, interactive), not an srun.
_SPECIAL_STEPS = 0xFFFFFFF0

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in hostlist {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    parts.append(text[start:])
    return [part for part in (p.strip() for p in parts) if part]


def _bracket(body: str, whole: str) -> list[str]:
    """The numbers of one bracket group (``01-04,07``), zero padding kept."""
    numbers: list[str] = []
    for item in body.split(","):
        found = _RANGE.match(item.strip())
        if found is None:
            raise ValueError(f"bad range {item!r} in hostlist {whole!r}")
        low, high = found.group(1), found.group(2)
        if high is None:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {item!r} runs backwards in hostlist {whole!r}")
        width = len(low) if low.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def expand_hostlist(expr: str) -> list[str]:
    """The host names of a Slurm hostlist expression, in order.

    ``gpu[01-04,07],cpu3`` is gpu01..gpu04, gpu07, cpu3: top-level commas separate items, a
    bracket holds numbers and ranges (zero padding kept, from the range's first number), and
    several brackets in one name multiply (``a[1-2]b[3-4]`` is a1b3 a1b4 a2b3 a2b4). Not handled
    (ValueError): nested brackets, stepped ranges, Slurm's multi-dimensional ``x`` syntax.
    """
    hosts: list[str] = []
    for item in _split_top(expr.strip()):
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", item):
            if piece.startswith("["):
                numbers = _bracket(piece[1:-1], expr)
                names = [name + number for name in names for number in numbers]
            elif piece:
                if "[" in piece or "]" in piece:
                    raise ValueError(f"unbalanced brackets in hostlist {expr!r}")
                names = [name + piece for name in names]
        hosts.extend(names)
    return hosts


def first_host(expr: str) -> str:
    """The first host of a hostlist expression ("" when it names none or is malformed)."""
    try:
        hosts = expand_hostlist(expr)
    except ValueError:
        return ""
    return hosts[0] if hosts else ""


def node_address(name: str, aliases: str) -> str:
    """The address ``SLURM_NODE_ALIASES`` (``name:addr:hostname,...``, IPv6 in brackets) gives
    node ``name``, or ``name`` itself."""
    try:
        entries = _split_top(aliases)
    except ValueError:
        return name
    for entry in entries:
        node, _, rest = entry.partition(":")
        if node != name or not rest:
            continue
        closing = rest.find("]")
        if rest.startswith("[") and closing > 0:
            address = rest[1:closing]
        else:
            address = rest.partition(":")[0]
        if address:
            return f"[{address}]" if ":" in address else address
    return name


def _get(environ: Mapping[str, str], *names: str) -> tuple[str, str]:
    """(the value, its variable) of the first of ``names`` set and non-empty, else ("", "")."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value, name
    return "", ""


def _count(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _gpus(environ: Mapping[str, str]) -> tuple[int, str]:
    """(the GPUs Slurm gave this node, the variable saying so), or (0, "")."""
    on_node = _count(environ, "SLURM_GPUS_ON_NODE")
    if on_node is not None:
        return on_node, "SLURM_GPUS_ON_NODE"
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        listed = [part for part in environ.get(name, "").split(",") if part.strip()]
        if listed:
            return len(listed), name
    return 0, ""


def _endpoint(environ: Mapping[str, str], job: int, step: int) -> tuple[str, str] | None:
    """(``host:port``, its variables), or None when no host can be named."""
    host, host_var = _get(environ, "MASTER_ADDR")
    if host:
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address
    else:
        nodelist, host_var = _get(
            environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"
        )
        name = first_host(nodelist)
        if not name:
            return None
        host = node_address(name, environ.get("SLURM_NODE_ALIASES", ""))
        if host != name:
            host_var += ", SLURM_NODE_ALIASES"
    port, port_var = _get(environ, "MASTER_PORT")
    if not port.isdigit():
        port = str(STORE_PORT + (10 * job + step) % PORT_SPAN)
        port_var = "SLURM_JOB_ID, SLURM_STEP_ID"
    return f"{host}:{port}", f"{host_var}, {port_var}"


def detect(environ: Mapping[str, str]) -> Inference | None:
    """What a Slurm job step's task tells of the job (None: not a task of an srun step)."""
    job_text, job_var = _get(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    step_text, step_var = _get(environ, "SLURM_STEP_ID", "SLURM_STEPID")
    node_id = _count(environ, "SLURM_NODEID")
    if not job_text.isdigit() or not step_text.isdigit() or node_id is None:
        return None
    job, step = int(job_text), int(step_text)
    if step >= _SPECIAL_STEPS:
        return None
    ids = f"{job_var}, {step_var}"
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    nodes = _count(environ, "SLURM_STEP_NUM_NODES")
    nodes_var = "SLURM_STEP_NUM_NODES"
    if nodes is None:
        nodes, nodes_var = _count(environ, "SLURM_NNODES"), "SLURM_NNODES"
    tasks = _count(environ, "SLURM_STEP_NUM_TASKS")
    tasks_var = "SLURM_STEP_NUM_TASKS"
    if tasks is None:
        tasks, tasks_var = _count(environ, "SLURM_NTASKS"), "SLURM_NTASKS"
    one_per_node = tasks is None or tasks == nodes
    if one_per_node and nodes:
        values["nnodes"], sources["nnodes"] = (nodes, nodes), nodes_var
        values["node_rank"], sources["node_rank"] = node_id, "SLURM_NODEID"
    elif tasks:
        proc_id = _count(environ, "SLURM_PROCID")
        values["nnodes"] = (tasks, tasks)
        sources["nnodes"] = f"{tasks_var} (several tasks per node: one agent each)"
        if proc_id is not None:
            values["node_rank"], sources["node_rank"] = proc_id, "SLURM_PROCID"
    values["rdzv_backend"], sources["rdzv_backend"] = "c10d", ids
    endpoint = _endpoint(environ, job, step)
    if endpoint is not None:
        values["rdzv_endpoint"], sources["rdzv_endpoint"] = endpoint
    values["rdzv_id"], sources["rdzv_id"] = f"{job}.{step}", ids
    gpus, gpus_var = _gpus(environ)
    if gpus and one_per_node:
        values["nproc_per_node"], sources["nproc_per_node"] = str(gpus), gpus_var
    values["signals_to_handle"] = list(SIGNALS)
    sources["signals_to_handle"] = f"{job_var}: sbatch --signal=USR1@SECONDS asks to stop"
    return Inference(f"Slurm (job {job}, step {step})", values, sources)
