"""This machine, read once: its CPUs, its GPUs and their CPU topology, from /proc and sysfs; and
each local rank's placement on it, planned by ``relaunch.core.workers.placement``.

The one reader of the machine: the number of workers ``--nproc-per-node cpu/gpu/auto/gpu:LIST``
asks for (``cpu_count``, ``count_gpus``) and the placement (``placement_for``) read the same
GPUs, listed once per process. Loaded only when a launch needs either. The GPUs, in CUDA's
order (PCI bus order: that of identical GPUs, or of ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), are the
NVIDIA driver's ``/proc/driver/nvidia/gpus/<bus id>`` (only those of the container, inside one),
else ``nvidia-smi --query-gpu``; each one's NUMA node is
``/sys/bus/pci/devices/<bus id>/numa_node``. The workers see those of an inherited
``CUDA_VISIBLE_DEVICES`` when it is set. The CPUs are ``/sys/devices/system/node/node*/cpulist``
and ``/sys/devices/system/cpu/cpu*``'s package, thread siblings and caches, read only for the
mode in use and the nodes with a GPU.

``RELAUNCH_SYSFS_ROOT`` (for tests only) names a directory that stands in for ``/`` in every
one of these paths.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping

from relaunch.config import ConfigError, LaunchConfig
from relaunch.core.workers.placement import (
    Gpu,
    Placement,
    Topology,
    format_cpu_list,
    parse_cpu_list,
    plan_placement,
    visible_entries,
)

log = logging.getLogger(__name__)

#: A directory standing in for ``/`` in the paths read here: for tests only.
SYSFS_ROOT_ENV = "RELAUNCH_SYSFS_ROOT"


def cpu_count() -> int:
    """The CPUs of this machine (``--nproc-per-node cpu``)."""
    return os.cpu_count() or 1


def count_gpus(environ: Mapping[str, str]) -> int:
    """The GPUs the workers see, without importing a framework: those an inherited
    ``CUDA_VISIBLE_DEVICES`` lists, else the machine's (``list_gpus``)."""
    visible = visible_entries(environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        return len(visible)
    return len(list_gpus(environ.get(SYSFS_ROOT_ENV, "/"), environ))


def placement_for(config: LaunchConfig, environ: Mapping[str, str]) -> Placement | None:
    """The placement ``config`` asks for on this machine (None: none asked); ConfigError when it
    cannot be. Lines on what cannot be done (a rank that runs unbound) are logged as warnings."""
    return place_workers(
        config.nproc_per_node,
        environ,
        devices=config.devices,
        device_per_rank=config.device_per_rank,
        numa_binding=config.numa_binding,
        virtual_local_rank=config.virtual_local_rank,
    )


def place_workers(
    nproc: int,
    environ: Mapping[str, str],
    *,
    devices: tuple[int, ...] | None = None,
    device_per_rank: bool = False,
    numa_binding: str | None = None,
    virtual_local_rank: bool = False,
) -> Placement | None:
    """The placement of ``nproc`` local ranks on this machine
    (``core.workers.placement.plan_placement`` says what each option means; None: none asked);
    ConfigError when it cannot be."""
    if not (devices is not None or device_per_rank or numa_binding or virtual_local_rank):
        return None
    root = environ.get(SYSFS_ROOT_ENV, "/")
    inherited = environ.get("CUDA_VISIBLE_DEVICES")
    gpus: tuple[Gpu, ...] = ()
    if numa_binding or inherited is None:
        gpus = list_gpus(root, environ)
    topology = None
    if numa_binding and gpus:
        topology = read_topology(root, numa_binding, gpus)
    try:
        placement = plan_placement(
            nproc,
            subset=devices,
            device_per_rank=device_per_rank,
            numa_binding=numa_binding,
            inherited=inherited,
            gpu_count=len(gpus),
            topology=topology,
            virtual_local_rank=virtual_local_rank,
        )
    except ValueError as exc:
        raise ConfigError(f"cannot place the workers: {exc}") from None
    for note in placement.notes:
        log.warning("%s", note)
    for rank, place in enumerate(placement.ranks):
        shown = [f"{name}={value}" for name, value in place.env.items()]
        if place.cpus is not None:
            shown.append(f"CPUs {format_cpu_list(place.cpus)}")
        log.info("local rank %d: %s", rank, ", ".join(shown) or "as launched")
    return placement


def _path(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read().strip()
    except OSError:
        return None


def _bus_id(text: str) -> str:
    """``00000000:1B:00.0`` (nvidia-smi) or ``0000:1b:00.0`` -> ``0000:1b:00.0`` (sysfs)."""
    parts = text.strip().lower().split(":", 2)
    return text.strip().lower() if len(parts) != 3 else f"{parts[0][-4:]:0>4}:{parts[1]}:{parts[2]}"


def list_gpus(root: str, environ: Mapping[str, str]) -> tuple[Gpu, ...]:
    """The machine's NVIDIA GPUs in PCI bus order, each with its NUMA node (-1: unknown) and
    UUID ("": unknown); () when none can be found. Read once per process (for each ``root`` and
    ``PATH``): counting the GPUs and placing the workers see the same ones."""
    return _list_gpus(root, environ.get("PATH", os.defpath))


@functools.cache
def _list_gpus(root: str, path: str) -> tuple[Gpu, ...]:
    found: dict[str, str] = {}  # bus id -> uuid
    driver = _path(root, "/proc/driver/nvidia/gpus")
    try:
        names = os.listdir(driver)
    except OSError:
        names = []
    for name in names:
        uuid = ""
        for line in (_read(os.path.join(driver, name, "information")) or "").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "GPU UUID":
                uuid = value.strip()
        found[_bus_id(name)] = uuid
    if not found:
        found = dict(_query_nvidia_smi(path))
    gpus = []
    for bus_id in sorted(found):
        node = _read(_path(root, f"/sys/bus/pci/devices/{bus_id}/numa_node"))
        numa_node = int(node) if node is not None and node.lstrip("-").isdigit() else -1
        gpus.append(Gpu(bus_id, numa_node, found[bus_id]))
    return tuple(gpus)


def _query_nvidia_smi(path: str) -> Iterable[tuple[str, str]]:
    binary = shutil.which("nvidia-smi", path=path)
    if binary is None:
        return ()
    try:
        listing = subprocess.run(
            [binary, "--query-gpu=pci.bus_id,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    rows = [line.split(",") for line in listing.splitlines() if line.count(",") == 1]
    return [(_bus_id(bus), uuid.strip()) for bus, uuid in rows if bus.count(":") == 2]


def read_topology(root: str, mode: str, gpus: tuple[Gpu, ...]) -> Topology:
    """The CPU topology ``mode`` needs, for the NUMA nodes of ``gpus``."""
    allowed = frozenset(os.sched_getaffinity(0))
    node_dir = _path(root, "/sys/devices/system/node")
    node_cpus: dict[int, frozenset[int]] = {}
    try:
        entries = os.listdir(node_dir)
    except OSError:
        entries = []
    for entry in entries:
        if entry.startswith("node") and entry[4:].isdigit():
            text = _read(os.path.join(node_dir, entry, "cpulist"))
            if text is not None:
                node_cpus[int(entry[4:])] = parse_cpu_list(text)
    if not node_cpus:  # a kernel without NUMA: one node of every CPU
        online = _read(_path(root, "/sys/devices/system/cpu/online"))
        node_cpus[0] = parse_cpu_list(online) if online else allowed
    cpu_dir = _path(root, "/sys/devices/system/cpu")
    near = frozenset().union(
        *(node_cpus.get(max(gpu.numa_node, 0), frozenset()) & allowed for gpu in gpus)
    )
    sockets: dict[int, int] = {}
    cores: dict[int, frozenset[int]] = {}
    caches: dict[int, frozenset[int]] = {}
    if mode == "socket":
        for cpus in node_cpus.values():
            if cpus & allowed:
                first = min(cpus & allowed)
                package = _read(f"{cpu_dir}/cpu{first}/topology/physical_package_id")
                if package is not None and package.lstrip("-").isdigit():
                    sockets[first] = int(package)
    elif mode == "exclusive":
        _sharing(
            near, cores, lambda cpu: _read(f"{cpu_dir}/cpu{cpu}/topology/thread_siblings_list")
        )
    elif mode == "core-complex":
        _sharing(near, caches, lambda cpu: _last_level_cache(f"{cpu_dir}/cpu{cpu}/cache"))
    return Topology(gpus, node_cpus, allowed, sockets, cores, caches)


def _sharing(
    cpus: Iterable[int], into: dict[int, frozenset[int]], read: Callable[[int], str | None]
) -> None:
    """Each CPU's sharers (``read(cpu)``: a CPU list), read once per group of sharers."""
    for cpu in sorted(cpus):
        if cpu in into:
            continue
        text = read(cpu)
        group = (parse_cpu_list(text) if text else frozenset()) | {cpu}
        for member in group:
            into.setdefault(member, group)


def _last_level_cache(cache_dir: str) -> str | None:
    """The CPUs sharing the highest-level data or unified cache under ``cache_dir``, as torch
    2.13 picks it."""
    best, shared = -1, None
    try:
        entries = os.listdir(cache_dir)
    except OSError:
        return None
    for entry in entries:
        if not (entry.startswith("index") and entry[5:].isdigit()):
            continue
        if _read(f"{cache_dir}/{entry}/type") not in ("Unified", "Data"):
            continue
        level = _read(f"{cache_dir}/{entry}/level")
        if level is not None and level.isdigit() and int(level) > best:
            best, shared = int(level), _read(f"{cache_dir}/{entry}/shared_cpu_list")
    return shared
