"""Device placement, planned from fake topologies: GPU subsets, a device per rank, NUMA binding."""

from __future__ import annotations

import argparse

import pytest

from relaunch import cli
from relaunch.cli.args import resolve_nproc
from relaunch.config import ConfigError, LaunchConfig
from relaunch.core.workers.placement import (
    Gpu,
    Topology,
    format_cpu_list,
    parse_cpu_list,
    parse_index_list,
    plan_cpus,
    plan_placement,
    worker_devices,
)


def cpus(text: str) -> frozenset[int]:
    return parse_cpu_list(text)


def machine(allowed: str = "0-31", gpus_per_node: int = 2) -> Topology:
    """2 sockets x 2 NUMA nodes of 8 CPUs (4 cores of 2 hyperthreads, 2 L3 caches of 4 CPUs),
    ``gpus_per_node`` GPUs on each node, in order."""
    node_cpus = {node: frozenset(range(8 * node, 8 * node + 8)) for node in range(4)}
    return Topology(
        gpus=tuple(
            Gpu(f"0000:{gpu + 1:02x}:00.0", gpu // gpus_per_node, f"GPU-{gpu}aaa")
            for gpu in range(4 * gpus_per_node)
        ),
        node_cpus=node_cpus,
        allowed=cpus(allowed),
        sockets={cpu: cpu // 16 for cpu in range(32)},
        cores={cpu: frozenset({cpu & ~1, cpu | 1}) for cpu in range(32)},
        caches={cpu: frozenset(range(cpu & ~3, (cpu & ~3) + 4)) for cpu in range(32)},
    )


@pytest.mark.parametrize(
    ("text", "indexes"),
    [("1,3", (1, 3)), ("0-3", (0, 1, 2, 3)), ("4,0-1", (4, 0, 1)), (" 2 ", (2,)), ("7-7", (7,))],
)
def test_index_lists(text: str, indexes: tuple[int, ...]) -> None:
    assert parse_index_list(text) == indexes


@pytest.mark.parametrize("text", ["", "a", "1,", "3-1", "1,1", "0-2,2", "-1", "1-", "1.5"])
def test_bad_index_lists(text: str) -> None:
    with pytest.raises(ValueError):
        parse_index_list(text)


def test_cpu_lists_round_trip() -> None:
    assert parse_cpu_list("0-2,4,6-7\n") == {0, 1, 2, 4, 6, 7}
    assert format_cpu_list({7, 0, 1, 2, 4, 6}) == "0-2,4,6-7"
    assert parse_cpu_list("") == frozenset()
    assert format_cpu_list([5]) == "5"


def test_worker_devices_count_the_gpus_the_launcher_sees() -> None:
    assert worker_devices((1, 3), None, 4) == ("1", "3")
    assert worker_devices((1, 3), "4,5,6,7", 8) == ("5", "7")
    assert worker_devices((0,), "GPU-abc, GPU-def", 0) == ("GPU-abc",)
    assert worker_devices(None, "2,3", 8) == ("2", "3")
    assert worker_devices(None, None, 3) == ("0", "1", "2")
    assert worker_devices((5,), None, 0) == ("5",)  # nothing counted: taken as written
    with pytest.raises(ValueError, match=r"GPU 4 does not exist: this machine has 4 \(0-3\)"):
        worker_devices((1, 4), None, 4)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=4,5 lists 2"):
        worker_devices((2,), "4,5", 8)
    with pytest.raises(ValueError, match="lists 0"):
        worker_devices((0,), "", 8)


def test_a_subset_is_seen_by_every_worker_in_its_order() -> None:
    placement = plan_placement(2, subset=(3, 1), gpu_count=4)
    assert [placement.env(r) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": "3,1"}] * 2
    assert placement.cpus() == {} and placement.notes == ()


def test_a_device_per_rank() -> None:
    per_rank = plan_placement(2, subset=(1, 3), device_per_rank=True, gpu_count=4)
    assert [per_rank.env(r) for r in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "1"},
        {"CUDA_VISIBLE_DEVICES": "3"},
    ]
    inherited = plan_placement(2, device_per_rank=True, inherited="GPU-a,GPU-b,GPU-c")
    assert [inherited.env(r)["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["GPU-a", "GPU-b"]
    counted = plan_placement(3, device_per_rank=True, gpu_count=8)
    assert [counted.env(r)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == ["0", "1", "2"]
    with pytest.raises(ValueError, match=r"3 workers, but the launcher sees only 2 \(0,1\)"):
        plan_placement(3, device_per_rank=True, gpu_count=2)
    with pytest.raises(ValueError, match="sees none"):
        plan_placement(1, device_per_rank=True, gpu_count=0)


def test_nothing_asked_changes_nothing() -> None:
    placement = plan_placement(2, inherited="0,1", gpu_count=2)
    assert placement.env(0) == {} and placement.cpus() == {}


def bound(mode: str, nproc: int, topology: Topology, **kwargs: object) -> list[str]:
    placement = plan_placement(
        nproc, numa_binding=mode, gpu_count=len(topology.gpus), topology=topology, **kwargs
    )
    assert placement.notes == ()
    return [format_cpu_list(placement.cpus()[rank]) for rank in range(nproc)]


def test_node_binds_each_rank_to_its_gpus_numa_node() -> None:
    assert bound("node", 8, machine()) == ["0-7"] * 2 + ["8-15"] * 2 + ["16-23"] * 2 + ["24-31"] * 2
    # gpu:1,5: local rank 0 is GPU 1 (node 0), local rank 1 GPU 5 (node 2)
    assert bound("node", 2, machine(), subset=(1, 5)) == ["0-7", "16-23"]
    # an inherited CUDA_VISIBLE_DEVICES, by index or UUID: local rank i is its i-th entry
    assert bound("node", 2, machine(), inherited="6,2") == ["24-31", "8-15"]
    assert bound("node", 1, machine(), inherited="GPU-3a") == ["8-15"]


def test_socket_binds_to_every_node_of_the_gpus_socket() -> None:
    assert bound("socket", 8, machine()) == ["0-15"] * 4 + ["16-31"] * 4


def test_exclusive_splits_a_nodes_cores_between_its_gpus() -> None:
    assert bound("exclusive", 4, machine()) == ["0-3", "4-7", "8-11", "12-15"]
    # 3 GPUs on a node of 4 cores: the first gets one more, hyperthreads stay together
    three = machine(gpus_per_node=3)
    assert bound("exclusive", 3, three) == ["0-3", "4-5", "6-7"]
    # only the GPUs this node's workers use share the node: gpu:1 alone has all of it
    assert bound("exclusive", 1, machine(), subset=(1,)) == ["0-7"]


def test_core_complex_gives_each_gpu_of_a_node_its_own_cache() -> None:
    assert bound("core-complex", 4, machine()) == ["0-3", "4-7", "8-11", "12-15"]
    assert bound("core-complex", 3, machine(gpus_per_node=3)) == ["0-3", "4-7", "0-3"]
    # the cache with the most allowed CPUs comes first
    assert bound("core-complex", 2, machine(allowed="0-4")) == ["0-3", "4"]


def test_only_the_launchers_cpus_are_used() -> None:
    assert bound("node", 1, machine(allowed="2-5,9")) == ["2-5"]
    placement = plan_placement(3, numa_binding="node", gpu_count=8, topology=machine(allowed="0-7"))
    assert placement.cpus() == {0: cpus("0-7"), 1: cpus("0-7")}
    assert placement.notes == (
        "--numa-binding node: local rank 2 (GPU 2, NUMA node 1): none of the node's CPUs is "
        "allowed to this launcher: it runs on any CPU",
    )


def test_a_gpu_of_unknown_node_is_on_node_0() -> None:
    topology = Topology((Gpu("0000:01:00.0", -1),), {0: cpus("0-1")}, cpus("0-1"))
    assert bound("node", 1, topology) == ["0-1"]


def test_what_cannot_be_bound_is_said_in_one_line() -> None:
    none = plan_placement(2, numa_binding="node", gpu_count=0, topology=None)
    assert none.cpus() == {}
    assert none.notes == ("--numa-binding node: no GPU found: the workers run on any CPU",)
    odd = plan_placement(
        3, numa_binding="socket", inherited="0,MIG-x", gpu_count=8, topology=machine()
    )
    assert odd.cpus() == {0: cpus("0-15")}
    assert odd.notes == (
        "--numa-binding socket: local rank 1's GPU 'MIG-x' is not one of the machine's; "
        "local rank 2 has no GPU: they run on any CPU",
    )
    few_cores = machine(gpus_per_node=5)
    assert plan_cpus("exclusive", [0, 1, 2, 3, 4], few_cores)[1][0] == (
        "local rank 0 (GPU 0, NUMA node 0): 4 physical cores cannot be split between 5 GPUs"
    )


def test_resolve_nproc_counts_a_subset() -> None:
    assert resolve_nproc("gpu:1,3", 2, 4) == 2
    assert resolve_nproc("gpu:0-5", 2, 0) == 6  # no GPU counted: not checked
    with pytest.raises(ConfigError, match="GPU 4 does not exist: the launcher sees 4"):
        resolve_nproc("gpu:1,4", 2, 4)


def parse(*argv: str, **env: str) -> argparse.Namespace:
    return cli.build_parser(dict(env)).parse_args([*argv, "job.py"])


def test_the_flags_and_their_variables() -> None:
    args = parse("--nproc-per-node", "gpu:0-2", "--numa-binding", "core-complex")
    assert (args.nproc_per_node, args.numa_binding, args.device_per_rank) == (
        "gpu:0,1,2",
        "core-complex",
        False,
    )
    args = parse(PET_NUMA_BINDING="socket", PET_DEVICE_PER_RANK="1", PET_NPROC_PER_NODE="gpu:3")
    assert (args.nproc_per_node, args.numa_binding, args.device_per_rank) == (
        "gpu:3",
        "socket",
        True,
    )
    assert parse("--device_per_rank", "--numa_binding", "node").device_per_rank


@pytest.mark.parametrize(
    "argv",
    [
        ("--nproc-per-node", "gpu:"),
        ("--nproc-per-node", "gpu:1,1"),
        ("--nproc-per-node", "gpu:a"),
        ("--numa-binding", "nodes"),
    ],
)
def test_bad_placement_flags_are_usage_errors(argv: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError):
        parse(*argv)


def test_launch_config_checks_placement() -> None:
    with pytest.raises(ConfigError, match="devices lists 2 GPUs for nproc_per_node=3"):
        LaunchConfig(1, 1, 3, devices=(0, 1))
    with pytest.raises(ConfigError, match="numa_binding 'cpu' is unknown"):
        LaunchConfig(1, 1, 1, numa_binding="cpu")
    assert LaunchConfig(1, 1, 2, devices=(3, 1), numa_binding="exclusive").devices == (3, 1)


# -- torch's virtual local ranks ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("inherited", "subset", "gpu_count", "seen"),
    [
        (None, None, 0, ["0", "1"]),  # no GPU counted: torch's rule, the rank's own index
        (None, None, 4, ["0", "1"]),
        ("5,7,9", None, 0, ["5", "7"]),  # the local rank-th of the inherited list
        ("4,5,6,7", (1, 3), 0, ["5", "7"]),  # the local rank-th of a gpu:LIST subset
    ],
)
def test_virtual_local_ranks_see_one_gpu_each_as_local_rank_0(
    inherited: str | None, subset: tuple[int, ...] | None, gpu_count: int, seen: list[str]
) -> None:
    placement = plan_placement(
        2, subset=subset, inherited=inherited, gpu_count=gpu_count, virtual_local_rank=True
    )
    assert placement.virtual_local_rank
    assert [placement.env(rank) for rank in (0, 1)] == [
        {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": device} for device in seen
    ]


def test_virtual_local_ranks_need_an_inherited_gpu_each() -> None:
    with pytest.raises(ValueError, match=r"local rank 1 exceeds .* CUDA_VISIBLE_DEVICES=3"):
        plan_placement(2, inherited="3", virtual_local_rank=True)
