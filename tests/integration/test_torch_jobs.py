"""Real torch.distributed jobs (gloo on CPU): one node, two nodes, a killed worker, a killed node.

The training script is ``examples/train_ddp.py``: the data of each step and rank is fixed, and
rank 0 checkpoints every step, so a run of the same world size ends with the same weights
however it was split across nodes or interrupted.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, said_until
from test_rendezvous import WAITING

from relaunch.endpoints import find_free_port

# Four workers importing torch keep both cores busy: these run one at a time, on one xdist worker.
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("torch")]

TRAIN = str(pathlib.Path(__file__).parents[2] / "examples" / "train_ddp.py")
STEPS = "12"
FAST = "keep_alive_interval=0.2,keep_alive_max_attempt=5,last_call_timeout=1,join_timeout=60"
#: The multi-node jobs' workers fork from a zygote that imported torch once a node (a restart's
#: too), not one import a worker; the reference and the killed worker's job start them cold.
PRELOAD = ("--preload", "torch")


def relaunch(
    leaks: LeakCheck, tmp_path: pathlib.Path, *flags: str, **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--tee", "1", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=leaks.process_env(OMP_NUM_THREADS="1", **env),
    )


def train(tmp_path: pathlib.Path, out: str, *extra: str) -> list[str]:
    return [
        TRAIN,
        "--steps",
        STEPS,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--out",
        str(tmp_path / out),
        *extra,
    ]


def _torch():  # type: ignore[no-untyped-def]
    """torch, imported only by the tests that read weights (it takes seconds to import)."""
    try:
        import torch
    except ImportError:  # CI must prove the torch jobs work: never skip
        pytest.fail("torch is not installed: run `make test`, which installs torch==2.13.0")
    return torch


def weights(path: pathlib.Path) -> dict[str, object]:
    return _torch().load(path)  # type: ignore[no-any-return]


def same_weights(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(_torch().equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The job on 4 local workers, uninterrupted: the weights every other run must match."""
    tmp_path = tmp_path_factory.mktemp("reference")
    leaks = LeakCheck()
    node = relaunch(
        leaks, tmp_path, "--standalone", "--nproc-per-node", "4", *train(tmp_path, "weights.pt")
    )
    out, err = node.communicate(timeout=200)
    assert node.returncode == 0, err
    losses = [float(line.split()[-1]) for line in out.splitlines() if " loss " in line]
    assert len(losses) == int(STEPS) and losses[-1] < losses[0] / 2, "it learns"
    yield weights(tmp_path / "weights.pt")


def test_four_local_workers_train_and_checkpoint(reference: dict[str, object]) -> None:
    assert set(reference) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_two_nodes_of_two_workers_end_with_the_single_node_weights(
    tmp_path: pathlib.Path, leaks: LeakCheck, reference: dict[str, object]
) -> None:
    endpoint = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    nodes = [
        relaunch(
            leaks,
            tmp_path,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            *PRELOAD,
            *train(tmp_path, "weights.pt"),
        )
        for _ in range(2)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=200)
        assert node.returncode == 0, err
    assert same_weights(weights(tmp_path / "weights.pt"), reference)


def worker_pids(agent_pid: int) -> dict[str, int]:
    """The agent's workers by ``LOCAL_RANK``, found in /proc."""
    pids = {}
    for task in os.listdir(f"/proc/{agent_pid}/task"):
        with open(f"/proc/{agent_pid}/task/{task}/children") as file:
            for pid in map(int, file.read().split()):
                try:
                    with open(f"/proc/{pid}/environ", "rb") as env:
                        variables = dict(
                            item.split(b"=", 1) for item in env.read().split(b"\0") if b"=" in item
                        )
                except OSError:
                    continue
                if b"LOCAL_RANK" in variables:
                    pids[variables[b"LOCAL_RANK"].decode()] = pid
    return pids


def wait_for_step(node: subprocess.Popen[str], step: int, seen: list[str]) -> None:
    """Read the job's output until rank 0 reports ``step``."""
    assert node.stdout is not None
    for line in node.stdout:
        seen.append(line)
        if line.startswith(f"[default0]:step {step} "):
            return
    pytest.fail(f"the job ended before step {step}: {''.join(seen)}")


def test_a_killed_worker_restarts_the_group_which_resumes_to_the_same_weights(
    tmp_path: pathlib.Path, leaks: LeakCheck, reference: dict[str, object]
) -> None:
    node = relaunch(
        leaks,
        tmp_path,
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "1",
        *train(tmp_path, "weights.pt", "--step-time", "0.2"),
    )
    seen: list[str] = []
    wait_for_step(node, 4, seen)
    os.kill(worker_pids(node.pid)["1"], signal.SIGKILL)
    out, err = node.communicate(timeout=200)
    assert node.returncode == 0, err
    output = "".join(seen) + out
    assert "killed by SIGKILL" in err and "restart 1: rank 1 killed by SIGKILL" in err
    resumed = [line for line in output.splitlines() if "resuming from step" in line]
    assert len(resumed) == 1 and int(resumed[0].split()[3]) >= 4
    assert same_weights(weights(tmp_path / "weights.pt"), reference)


def test_a_killed_node_leaves_the_survivor_to_resume_and_finish(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    endpoint = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    flags = (
        *("--nnodes", "1:2", "--nproc-per-node", "2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
        *PRELOAD,
    )
    # The other first, the host once the other waits for its store: a cold start inside the
    # host's last call (1 s) left the host a world of its own. Whichever joins first leads the
    # round: the other waits for the host; the host (3 s) for the other, already up.
    wait_long = FAST.replace("last_call_timeout=1", "last_call_timeout=60") + ",is_host=false"
    other = relaunch(
        leaks,
        tmp_path,
        *(*flags, "--rdzv-conf", wait_long),
        *train(tmp_path, "other.pt", "--step-time", "0.3"),
    )
    said_until(other, WAITING)
    host = relaunch(
        leaks,
        tmp_path,
        *(*flags, "--rdzv-conf", FAST.replace("last_call_timeout=1", "last_call_timeout=3")),
        *train(tmp_path, "weights.pt", "--step-time", "0.3"),
    )
    seen: list[str] = []
    wait_for_step(host, 3, seen)
    other.kill()  # the whole node: the agent, and with it (its guardian) its workers
    other.communicate(timeout=60)
    out, err = host.communicate(timeout=200)
    assert host.returncode == 0, err
    assert "lost" in err, "the survivor noticed the lost node"
    resumed = [line for line in ("".join(seen) + out).splitlines() if "resuming from" in line]
    assert resumed and resumed[-1].endswith("(world size 2)")
    assert int(resumed[-1].split()[3]) >= 3, "it resumed from the checkpoint, not from 0"
    assert (tmp_path / "weights.pt").exists()


def test_the_elastic_launch_example_all_reduces_over_four_function_workers(
    leaks: LeakCheck,
) -> None:
    example = pathlib.Path(__file__).parents[2] / "examples" / "elastic_allreduce.py"
    done = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        env=leaks.process_env(OMP_NUM_THREADS="1"),
        timeout=200,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "{0: 6, 1: 6, 2: 6, 3: 6}"
