"""Device placement through the relaunch command, on a fake machine: 4 GPUs on 2 NUMA nodes.

The machine is a sysfs-shaped directory named by ``RELAUNCH_SYSFS_ROOT`` (for tests only) and a
fake ``nvidia-smi`` on ``PATH``. Its NUMA node 0 is CPU 0 and node 1 CPU 1, real CPUs, so the
workers' bindings can be checked with ``os.sched_getaffinity``.
"""

from __future__ import annotations

import os
import pathlib
import stat
import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 to bind to"
    ),
]

GPUS = {"0000:01:00.0": 0, "0000:02:00.0": 0, "0000:41:00.0": 1, "0000:42:00.0": 1}

JOB = """
import os
print("placed", os.environ["LOCAL_RANK"], os.environ.get("CUDA_VISIBLE_DEVICES", "unset") or "''",
      ",".join(map(str, sorted(os.sched_getaffinity(0)))), flush=True)
"""


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def machine(tmp_path: pathlib.Path) -> dict[str, str]:
    """The environment of a relaunch run on the fake machine."""
    root = tmp_path / "root"
    for index, (bus_id, node) in enumerate(GPUS.items()):
        write(
            root / f"proc/driver/nvidia/gpus/{bus_id}/information",
            f"Model: \t\t Fake GPU\nGPU UUID: \t GPU-fake{index}\nBus Location: \t {bus_id}\n",
        )
        write(root / f"sys/bus/pci/devices/{bus_id}/numa_node", f"{node}\n")
    for cpu in (0, 1):
        write(root / f"sys/devices/system/node/node{cpu}/cpulist", f"{cpu}\n")
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        write(topology / "physical_package_id", f"{cpu}\n")
        write(topology / "thread_siblings_list", f"{cpu}\n")
        cache = root / f"sys/devices/system/cpu/cpu{cpu}/cache/index3"
        write(cache / "type", "Unified\n")
        write(cache / "level", "3\n")
        write(cache / "shared_cpu_list", f"{cpu}\n")
    smi = tmp_path / "bin" / "nvidia-smi"
    write(
        smi,
        "#!/bin/sh\n"
        + "".join(f"echo 'GPU {i}: Fake GPU (UUID: GPU-fake{i})'\n" for i in range(len(GPUS))),
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    return {
        "RELAUNCH_SYSFS_ROOT": str(root),
        "PATH": f"{smi.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def relaunch(
    leaks: LeakCheck, machine: dict[str, str], tmp_path: pathlib.Path, *argv: str, **env: str
) -> subprocess.CompletedProcess[str]:
    environ = leaks.process_env(**machine, **env)
    if "CUDA_VISIBLE_DEVICES" not in env:
        environ.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv, str(tmp_path / "job.py")],
        capture_output=True,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=50,
    )


def placed(done: subprocess.CompletedProcess[str]) -> list[tuple[str, ...]]:
    assert done.returncode == 0, done.stderr
    return sorted(
        tuple(line.split()[1:]) for line in done.stdout.splitlines() if line.startswith("placed")
    )


def test_a_subset_bound_to_each_gpus_numa_node(
    machine: dict[str, str], tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    done = relaunch(
        leaks, machine, tmp_path, "--nproc-per-node", "gpu:1,3", "--numa-binding", "node"
    )
    # local rank 0 is GPU 1 (node 0: CPU 0), local rank 1 GPU 3 (node 1: CPU 1)
    assert placed(done) == [("0", "1,3", "0"), ("1", "1,3", "1")]
    assert "numa" not in done.stderr


def test_a_device_per_rank_in_function_workers(
    machine: dict[str, str], tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    done = relaunch(
        leaks,
        machine,
        tmp_path,
        "--nproc-per-node",
        "gpu:3,0",
        "--device-per-rank",
        "--run-path",
        PET_NUMA_BINDING="socket",
    )
    assert placed(done) == [("0", "3", "1"), ("1", "0", "0")]


def test_gpu_counts_and_an_inherited_list(
    machine: dict[str, str], tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    done = relaunch(leaks, machine, tmp_path, "--nproc-per-node", "gpu", "--device-per-rank")
    assert placed(done) == [
        ("0", "0", "0,1"),
        ("1", "1", "0,1"),
        ("2", "2", "0,1"),
        ("3", "3", "0,1"),
    ]
    # Slurm's list, by UUID: the subset indexes it, binding finds each GPU by its UUID
    done = relaunch(
        leaks,
        machine,
        tmp_path,
        "--nproc-per-node",
        "gpu:1",
        "--numa-binding",
        "exclusive",
        CUDA_VISIBLE_DEVICES="GPU-fake0,GPU-fake2",
    )
    assert placed(done) == [("0", "GPU-fake2", "1")]


def test_what_cannot_be_is_said_in_one_line(
    machine: dict[str, str], tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    done = relaunch(leaks, machine, tmp_path, "--nproc-per-node", "gpu:1,4")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "relaunch: error: --nproc-per-node gpu:1,4: GPU 4 does not exist: the launcher sees 4 "
        "(0-3; CUDA_VISIBLE_DEVICES or nvidia-smi -L) (see relaunch --help)"
    ]
    done = relaunch(leaks, machine, tmp_path, "--nproc-per-node", "gpu:1-")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "relaunch: error: argument --nproc-per-node/--nproc_per_node: gpu:LIST: expected "
        "indexes such as 1,3 or 0-3, got '1-' (see relaunch --help)"
    ]
    done = relaunch(leaks, machine, tmp_path, "--nproc-per-node", "5", "--device-per-rank")
    assert done.returncode == 2
    assert "but the launcher sees only 4 (0,1,2,3)" in done.stderr
    # no GPU: the workers run unbound, and the one line says why
    done = relaunch(
        leaks,
        machine,
        tmp_path,
        "--nproc-per-node",
        "2",
        "--numa-binding",
        "node",
        CUDA_VISIBLE_DEVICES="",
    )
    assert placed(done) == [("0", "''", "0,1"), ("1", "''", "0,1")]
    assert (
        "relaunch: --numa-binding node: no GPU found: the workers run on any CPU"
        in done.stderr.splitlines()
    )


def affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_start_processes_binds_functions(
    start_method: str, tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    from relaunch import start_processes

    context = start_processes(
        "w",
        affinity,
        {0: (), 1: (), 2: ()},
        leaks.envs(3),
        str(tmp_path),
        start_method,
        cpu_affinity={0: frozenset({1}), 1: frozenset({0})},
    )
    try:
        result = context.wait(30)
    finally:
        context.close()
    assert result is not None and result.return_values == {0: [1], 1: [0], 2: [0, 1]}


def test_start_processes_binds_binaries_and_not_the_launcher(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    from relaunch import Std, start_processes

    before = os.sched_getaffinity(0)
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    context = start_processes(
        "w",
        sys.executable,
        {0: ("-c", code), 1: ("-c", code)},
        leaks.envs(2),
        str(tmp_path),
        redirects=Std.OUT,
        cpu_affinity={1: frozenset({1})},
    )
    try:
        result = context.wait(30)
    finally:
        context.close()
    assert result is not None and not result.is_failed()
    outputs = [pathlib.Path(result.stdouts[rank]).read_text() for rank in (0, 1)]
    assert outputs == ["[0, 1]\n", "[1]\n"]
    assert os.sched_getaffinity(0) == before
