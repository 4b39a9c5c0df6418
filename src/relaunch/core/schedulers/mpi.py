"""The MPI environment, for ``core.schedulers.detect``: detect(environ) -> Inference | None.

``mpirun -npernode 1 relaunch train.py`` starts one relaunch per node, each an MPI rank: the
number of ranks is the number of nodes. Open MPI says it in ``OMPI_COMM_WORLD_SIZE``; MPICH's
Hydra and Intel MPI in ``PMI_SIZE``. The agents meet on the built-in store (``c10d``), hosted by
the agent that can bind the endpoint, which is the launching host: Open MPI's
``OMPI_MCA_orte_hnp_uri`` (``<jobid>;tcp://ADDR[,ADDR...]:PORT;...``, the first address) with
port 29400, as long as mpirun runs on one of the job's nodes (a batch script does). ``MASTER_ADDR``
and ``MASTER_PORT``, where set (``mpirun -x MASTER_ADDR=...``), name another host or port; under
PMI, which names no host, ``MASTER_ADDR`` is needed, and without it relaunch stops and asks for
the endpoint rather than giving each node a world of its own. The job id (Open MPI's
``OMPI_MCA_ess_base_jobid``, or PMIx's ``PMIX_NAMESPACE``) is the rendezvous id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relaunch.core.schedulers.inference import Inference

#: The port of the built-in store on the launching host (torchrun's default for ``c10d``).
STORE_PORT = 29400

#: (name in the line, size variable, rank variable), asked in order.
_FLAVOURS = [
    ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("MPI (PMI)", "PMI_SIZE", "PMI_RANK"),
]


def hnp_address(uri: str) -> str:
    """The first address of Open MPI's ``OMPI_MCA_orte_hnp_uri`` (IPv4 first), or ""."""
    found = ""
    for part in uri.split(";")[1:]:
        scheme, _, rest = part.partition("://")
        if scheme not in ("tcp", "tcp6") or not rest:
            continue
        first = rest.split(",")[0]
        if first.startswith("["):
            address = first[1:].partition("]")[0]
        else:
            address = first.rpartition(":")[0] if first.count(":") == 1 else first
        if scheme == "tcp" and address:
            return address
        found = found or address
    return f"[{found}]" if found else ""


def _world(environ: Mapping[str, str]) -> tuple[str, int, str, int, str] | None:
    """(the flavour's name, the number of ranks and the variable saying it, this process' rank
    and its variable), or None."""
    for name, size_var, rank_var in _FLAVOURS:
        size, rank = environ.get(size_var, "").strip(), environ.get(rank_var, "").strip()
        if size.isdigit() and int(size) > 0 and rank.isdigit() and int(rank) < int(size):
            return name, int(size), size_var, int(rank), rank_var
    return None


def detect(environ: Mapping[str, str]) -> Inference | None:
    """What an MPI rank's environment tells of the job (None: not started by mpirun)."""
    world = _world(environ)
    if world is None:
        return None
    name, size, size_var, rank, rank_var = world
    values: dict[str, Any] = {"nnodes": (size, size), "rdzv_backend": "c10d", "node_rank": rank}
    sources = {"nnodes": size_var, "rdzv_backend": size_var, "node_rank": rank_var}
    host, host_var = environ.get("MASTER_ADDR", "").strip(), "MASTER_ADDR"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    if not host:
        host = hnp_address(environ.get("OMPI_MCA_orte_hnp_uri", ""))
        host_var = "OMPI_MCA_orte_hnp_uri"
    port, port_var = environ.get("MASTER_PORT", "").strip(), "MASTER_PORT"
    if not port.isdigit():
        port, port_var = str(STORE_PORT), ""
    if host:
        values["rdzv_endpoint"] = f"{host}:{port}"
        sources["rdzv_endpoint"] = ", ".join(var for var in (host_var, port_var) if var)
    for var in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"):
        job = environ.get(var, "").strip()
        if job:
            values["rdzv_id"], sources["rdzv_id"] = job, var
            break
    return Inference(name, values, sources)
