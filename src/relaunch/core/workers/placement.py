"""Device placement: the GPUs each local rank sees and the CPUs it may run on. Pure.

Three options, each off by default:

- a subset of GPUs (``--nproc-per-node gpu:1,3``): one worker per listed GPU, and every worker
  sees just those, in that order (``CUDA_VISIBLE_DEVICES=1,3``), so that local rank ``i`` is
  ``cuda:i``, the ``i``-th listed GPU;
- a device per rank (``--device-per-rank``): local rank ``i`` sees only its own GPU (the
  ``i``-th of the subset, else of the inherited ``CUDA_VISIBLE_DEVICES``, else GPU ``i``);
- NUMA binding (``--numa-binding MODE``, torch 2.13's modes): each worker may run only on CPUs
  near its GPU, as ``plan_cpus`` says;
- torch's virtual local ranks (``virtual_local_rank``): a device per rank, and every worker's
  ``LOCAL_RANK`` is 0 (its one GPU is ``cuda:0``).

The indexes of a subset count the GPUs the launcher sees: with an inherited
``CUDA_VISIBLE_DEVICES=4,5,6,7``, ``gpu:1,3`` is ``5,7``. Entries of an inherited list are kept
as written (indexes or UUIDs). ``relaunch.placement`` reads the machine (its CPUs, GPUs and
``Topology``) and applies nothing; the process layer binds each worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from relaunch.core.defaults import NUMA_MODES


def parse_index_list(text: str) -> tuple[int, ...]:
    """``"1,3"`` -> (1, 3); ``"0-3"`` -> (0, 1, 2, 3); ``"4,0-1"`` -> (4, 0, 1): in the order
    written. ValueError for anything else, an empty list or an index listed twice."""
    found: list[int] = []
    for item in text.split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"expected indexes such as 1,3 or 0-3, got {text!r}")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"a range must not go down, got {item.strip()!r} in {text!r}")
        found.extend(range(first, last + 1))
    if len(set(found)) != len(found):
        raise ValueError(f"an index is listed twice in {text!r}")
    return tuple(found)


def parse_cpu_list(text: str) -> frozenset[int]:
    """A sysfs list such as ``"0-3,8,10-11"`` (blank: none)."""
    cpus: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        low, _, high = item.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 4} -> ``"0-2,4"``."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def visible_entries(visible: str | None) -> list[str] | None:
    """An inherited ``CUDA_VISIBLE_DEVICES`` as its entries (None: not set; "" or -1: none)."""
    if visible is None:
        return None
    if visible.strip() in ("", "-1"):
        return []
    return [entry.strip() for entry in visible.split(",")]


def virtual_devices(nproc: int, devices: Sequence[str], inherited: str | None) -> list[str]:
    """Each local rank's one GPU with torch's virtual local ranks: the rank-th of ``devices``
    (those the workers would see), else, with no ``CUDA_VISIBLE_DEVICES`` inherited and too few
    GPUs counted, the rank's own index (torch's rule); ValueError when an inherited list is
    shorter than ``nproc``."""
    if len(devices) < nproc and inherited is not None:
        raise ValueError(
            f"local rank {len(devices)} exceeds the GPUs of CUDA_VISIBLE_DEVICES={inherited}: "
            f"{nproc} workers with virtual_local_rank need one each"
        )
    return [devices[rank] if rank < len(devices) else str(rank) for rank in range(nproc)]


def worker_devices(
    subset: Sequence[int] | None, inherited: str | None, gpu_count: int
) -> tuple[str, ...]:
    """The device entries the workers use, in local rank order: the subset's, else every GPU the
    launcher sees (the inherited ``CUDA_VISIBLE_DEVICES``, else ``0..gpu_count-1``).

    ValueError when the subset names a GPU the launcher does not see (unless no GPU could be
    counted and nothing was inherited: the indexes are then taken as they are).
    """
    entries = visible_entries(inherited)
    seen = entries if entries is not None else [str(i) for i in range(gpu_count)]
    if subset is None:
        return tuple(seen)
    if entries is None and gpu_count == 0:
        return tuple(str(i) for i in subset)
    missing = [i for i in subset if i >= len(seen)]
    if missing:
        where = (
            f"CUDA_VISIBLE_DEVICES={inherited} lists {len(seen)}"
            if entries is not None
            else f"this machine has {len(seen)}"
        )
        raise ValueError(f"GPU {missing[0]} does not exist: {where} (0-{len(seen) - 1})")
    return tuple(seen[i] for i in subset)


@dataclass(frozen=True)
class Gpu:
    """One GPU of the machine, in CUDA's order: its PCI address, NUMA node and UUID."""

    bus_id: str
    numa_node: int
    uuid: str = ""


@dataclass(frozen=True)
class Topology:
    """What NUMA binding needs to know of the machine.

    ``gpus`` in CUDA's order (PCI bus order); ``node_cpus`` every NUMA node's CPUs; ``allowed``
    the CPUs the launcher may use (its affinity); ``sockets`` each CPU's package; ``cores`` each
    CPU's hyperthread siblings (itself included); ``caches`` the CPUs sharing its last-level
    cache. The last three need only cover the CPUs of the mode in use.
    """

    gpus: tuple[Gpu, ...]
    node_cpus: Mapping[int, frozenset[int]]
    allowed: frozenset[int]
    sockets: Mapping[int, int] = field(default_factory=dict)
    cores: Mapping[int, frozenset[int]] = field(default_factory=dict)
    caches: Mapping[int, frozenset[int]] = field(default_factory=dict)

    def node_allowed(self, node: int) -> frozenset[int]:
        return self.node_cpus.get(node, frozenset()) & self.allowed


def find_gpu(entry: str, gpus: Sequence[Gpu]) -> int | None:
    """The position in ``gpus`` of a ``CUDA_VISIBLE_DEVICES`` entry: an index, or a UUID (or a
    unique prefix of one, as CUDA accepts); None if it names none of them."""
    if entry.isdigit():
        return int(entry) if int(entry) < len(gpus) else None
    matches = [i for i, gpu in enumerate(gpus) if gpu.uuid and gpu.uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def plan_cpus(
    mode: str, rank_gpus: Sequence[int | None], topology: Topology
) -> tuple[list[frozenset[int] | None], dict[int, str]]:
    """The CPUs of each local rank under ``mode`` (None: unbound), and why, for each local rank
    that runs unbound. ``rank_gpus[i]`` is local rank ``i``'s GPU, a position in
    ``topology.gpus`` (None: it has none). As torch 2.13's modes, within ``topology.allowed``:

    - ``node``: the CPUs of the GPU's NUMA node;
    - ``socket``: those of every NUMA node of the GPU's socket;
    - ``exclusive``: the physical cores of the GPU's node split evenly between the GPUs of this
      node's workers on that node, in order, the first ones getting one more when it is uneven;
    - ``core-complex``: one last-level cache's CPUs of the GPU's node, the caches with the most
      CPUs first, the ``k``-th GPU of the node getting the ``k``-th cache (modulo their number).
    """
    if mode not in NUMA_MODES:
        raise ValueError(f"unknown NUMA binding mode {mode!r}: expected one of {NUMA_MODES}")
    plans: list[frozenset[int] | None] = []
    notes: dict[int, str] = {}
    used = sorted({gpu for gpu in rank_gpus if gpu is not None})
    for rank, gpu in enumerate(rank_gpus):
        if gpu is None:
            plans.append(None)
            notes[rank] = f"local rank {rank} has no GPU"
            continue
        node = max(topology.gpus[gpu].numa_node, 0)  # -1: a machine of one node
        peers = [g for g in used if max(topology.gpus[g].numa_node, 0) == node]
        cpus, why = _mode_cpus(mode, node, peers.index(gpu), len(peers), topology)
        if not cpus:
            plans.append(None)
            notes[rank] = f"local rank {rank} (GPU {gpu}, NUMA node {node}): {why}"
        else:
            plans.append(cpus)
    return plans, notes


def _mode_cpus(
    mode: str, node: int, nth: int, peers: int, topology: Topology
) -> tuple[frozenset[int], str]:
    cpus = topology.node_allowed(node)
    if not cpus:
        return frozenset(), "none of the node's CPUs is allowed to this launcher"
    if mode == "node":
        return cpus, ""
    if mode == "socket":
        socket = topology.sockets.get(min(cpus))
        if socket is None:
            return frozenset(), "the socket of its CPUs is unknown"
        same = (
            topology.node_allowed(other)
            for other in topology.node_cpus
            if topology.node_allowed(other)
            and topology.sockets.get(min(topology.node_allowed(other))) == socket
        )
        return frozenset().union(*same), ""
    if mode == "exclusive":
        cores = _group(cpus, topology.cores)
        if len(cores) < peers:
            return frozenset(), f"{len(cores)} physical cores cannot be split between {peers} GPUs"
        share, extra = divmod(len(cores), peers)
        start = nth * share + min(nth, extra)
        end = start + share + (1 if nth < extra else 0)
        return frozenset().union(*cores[start:end]), ""
    caches = sorted(_group(cpus, topology.caches), key=lambda group: (-len(group), min(group)))
    return caches[nth % len(caches)], ""


def _group(cpus: frozenset[int], sharing: Mapping[int, frozenset[int]]) -> list[frozenset[int]]:
    """``cpus`` grouped by what they share (a core, a cache), in order of their lowest CPU; a
    CPU whose sharers are unknown is a group of its own."""
    groups: dict[int, set[int]] = {}
    for cpu in sorted(cpus):
        groups.setdefault(min(sharing.get(cpu, frozenset({cpu}))), set()).add(cpu)
    return [frozenset(groups[key]) for key in sorted(groups)]


@dataclass(frozen=True)
class RankPlacement:
    """One local rank's placement: variables to set, and CPUs to run on (None: any)."""

    env: Mapping[str, str]
    cpus: frozenset[int] | None = None


@dataclass(frozen=True)
class Placement:
    """Every local rank's placement, and lines to tell the user (what could not be done)."""

    ranks: tuple[RankPlacement, ...]
    notes: tuple[str, ...] = ()
    #: torch's virtual local ranks: ``LOCAL_RANK=0`` and a GPU each.
    virtual_local_rank: bool = False

    def env(self, local_rank: int) -> dict[str, str]:
        return dict(self.ranks[local_rank].env)

    def cpus(self) -> dict[int, frozenset[int]]:
        """The bound ranks' CPUs, by local rank."""
        return {rank: p.cpus for rank, p in enumerate(self.ranks) if p.cpus is not None}


def plan_placement(
    nproc: int,
    *,
    subset: Sequence[int] | None = None,
    device_per_rank: bool = False,
    numa_binding: str | None = None,
    inherited: str | None = None,
    gpu_count: int = 0,
    topology: Topology | None = None,
    virtual_local_rank: bool = False,
) -> Placement:
    """The placement of ``nproc`` local ranks; ValueError when it cannot be (a subset GPU that
    does not exist, more ranks than GPUs for a device each).

    ``inherited`` is the launcher's ``CUDA_VISIBLE_DEVICES`` (None: unset), ``gpu_count`` the
    GPUs it sees otherwise, ``topology`` the machine (needed only with ``numa_binding``).
    ``virtual_local_rank`` (torch's): each rank sees only its own GPU and has ``LOCAL_RANK=0``.
    """
    if subset is not None and len(subset) != nproc:
        raise ValueError(f"{nproc} workers for the {len(subset)} GPUs of gpu:LIST")
    devices = worker_devices(subset, inherited, gpu_count)
    per_rank = device_per_rank
    if per_rank and nproc > len(devices):
        seen = "none" if not devices else f"only {len(devices)} ({','.join(devices)})"
        raise ValueError(f"a device per rank for {nproc} workers, but the launcher sees {seen}")
    envs: list[dict[str, str]] = [{} for _ in range(nproc)]
    if virtual_local_rank:
        devices = tuple(virtual_devices(nproc, devices, inherited if subset is None else None))
    for rank, env in enumerate(envs):
        if virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            env["CUDA_VISIBLE_DEVICES"] = devices[rank]
        elif per_rank:
            env["CUDA_VISIBLE_DEVICES"] = devices[rank]
        elif subset is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    cpus: list[frozenset[int] | None] = [None] * nproc
    notes: list[str] = []
    if numa_binding is not None:
        cpus, notes = _bind(numa_binding, nproc, devices, topology)
    return Placement(
        tuple(RankPlacement(env, rank_cpus) for env, rank_cpus in zip(envs, cpus, strict=True)),
        tuple(notes),
        virtual_local_rank,
    )


def _bind(
    mode: str, nproc: int, devices: Sequence[str], topology: Topology | None
) -> tuple[list[frozenset[int] | None], list[str]]:
    prefix = f"--numa-binding {mode}: "
    if topology is None or not topology.gpus or not devices:
        return [None] * nproc, [prefix + "no GPU found: the workers run on any CPU"]
    rank_gpus: list[int | None] = []
    missing: dict[int, str] = {}
    for rank in range(nproc):
        gpu = find_gpu(devices[rank], topology.gpus) if rank < len(devices) else None
        if gpu is None and rank < len(devices):
            missing[rank] = f"local rank {rank}'s GPU {devices[rank]!r} is not one of the machine's"
        rank_gpus.append(gpu)
    cpus, unbound = plan_cpus(mode, rank_gpus, topology)
    reasons = {**unbound, **missing}
    if reasons:
        told = "; ".join(reasons[rank] for rank in sorted(reasons))
        return cpus, [f"{prefix}{told}: {'they run' if len(reasons) > 1 else 'it runs'} on any CPU"]
    return cpus, []
