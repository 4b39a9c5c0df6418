"""relaunch under a real Slurm: ``srun -N2 --ntasks-per-node=1 relaunch job.py`` with no
rendezvous flags forms one job of every node's workers, and Slurm's warning signal stops it
cleanly with the status that asks a wrapper to requeue.

The cluster (``tests/slurm_cluster.py``) is one slurmctld and three slurmd on this machine,
nodes n1-n3, started once for this module; it needs root and installs slurm-wlm and munge.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster
from conftest import LeakCheck, pid_alive, wait_until
from slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.slow]

#: What a worker records: its place in the job, its agent and Slurm's ids.
RECORD = """
import json, os, sys
out = sys.argv[1]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
        "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_NODEID")
record = {key: os.environ.get(key) for key in keys}
record["agent"] = os.getppid()
with open(os.path.join(out, "rank%s.json" % os.environ["RANK"]), "w") as file:
    json.dump(record, file)
"""

#: A worker that runs until it is asked to stop, then says so and exits 0.
UNTIL_STOPPED = (
    RECORD
    + """
import signal, time
import relaunch
relaunch.stop_requested()  # listen from the start
partial = os.path.join(out, "partial.%s" % os.environ["RANK"])
with open(partial, "w") as file:  # whole or not there: the test reads it once it is there
    file.write(str(signal.getsignal(signal.SIGUSR1)))
os.replace(partial, os.path.join(out, "usr1.%s" % os.environ["RANK"]))
deadline = time.monotonic() + 60
while not relaunch.stop_requested():
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
open(os.path.join(out, "stopped.%s" % os.environ["RANK"]), "w").close()
"""
)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """The three-node cluster; fails (never skips) where it cannot be installed or started."""
    problem = slurm_cluster.install()
    if problem is not None:
        pytest.fail(f"no Slurm to test against: {problem} (run `make install-test` as root)")
    with SlurmCluster().start() as cluster:
        yield cluster


def _script(tmp_path: Path, body: str) -> tuple[str, str]:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(body))
    out = tmp_path / "out"
    out.mkdir()
    return str(job), str(out)


def _env(slurm: SlurmCluster, leaks: LeakCheck) -> dict[str, str]:
    env = {
        name: value
        for name, value in leaks.process_env().items()
        if not name.startswith(("SLURM_", "SBATCH_", "SRUN_", "PET_", "MASTER_"))
    }
    return {**env, "SLURM_CONF": slurm.conf, "PYTHONUNBUFFERED": "1"}


def _srun(nodes: int, *relaunch_args: str, srun_flags: tuple[str, ...] = ()) -> list[str]:
    return [
        "srun",
        f"-N{nodes}",
        "--ntasks-per-node=1",
        *srun_flags,
        sys.executable,
        "-m",
        "relaunch",
        *relaunch_args,
    ]


def _records(out: str) -> list[dict[str, object]]:
    found = sorted(name for name in os.listdir(out) if name.startswith("rank"))
    return [json.loads(Path(out, name).read_text()) for name in found]


def _inference_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "running under Slurm" in line]


def _run_group(slurm: SlurmCluster, leaks: LeakCheck, tmp_path: Path, nodes: int) -> None:
    job, out = _script(tmp_path, RECORD)
    done = subprocess.run(
        _srun(nodes, "--nproc-per-node", "2", job, out),
        env=_env(slurm, leaks),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    records = _records(out)
    world = 2 * nodes
    assert sorted(int(str(r["RANK"])) for r in records) == list(range(world)), done.stderr
    assert {r["WORLD_SIZE"] for r in records} == {str(world)}
    assert len({r["agent"] for r in records}) == nodes  # one relaunch per node
    assert sorted(int(str(r["GROUP_RANK"])) for r in records) == sorted(
        [node for node in range(nodes) for _ in range(2)]
    )
    job_id = records[0]["SLURM_JOB_ID"]
    assert {r["TORCHELASTIC_RUN_ID"] for r in records} == {f"{job_id}.0"}
    lines = _inference_lines(done.stderr)
    assert len(lines) == nodes, done.stderr  # one line per relaunch
    for line in lines:
        assert f"--nnodes {nodes} (SLURM_STEP_NUM_NODES)" in line
        assert "--rdzv-backend c10d" in line
        assert "--rdzv-endpoint n1:" in line and "(SLURM_STEP_NODELIST" in line
        assert f"--rdzv-id {job_id}.0 (SLURM_JOB_ID, SLURM_STEP_ID)" in line
        assert "SIGUSR1" in line
        assert "--nproc-per-node" not in line  # given, and no GPUs here anyway


@pytest.mark.timeout(150)
def test_two_nodes_with_no_rendezvous_flags(slurm: SlurmCluster, leaks: LeakCheck, tmp_path):
    _run_group(slurm, leaks, tmp_path, 2)


@pytest.mark.timeout(150)
def test_three_nodes_with_no_rendezvous_flags(slurm: SlurmCluster, leaks: LeakCheck, tmp_path):
    _run_group(slurm, leaks, tmp_path, 3)


@pytest.mark.timeout(150)
def test_explicit_flags_win(slurm: SlurmCluster, leaks: LeakCheck, tmp_path):
    job, out = _script(tmp_path, RECORD)
    done = subprocess.run(
        _srun(2, "--rdzv-id", "mine", "--nproc_per_node=1", job, out),
        env=_env(slurm, leaks),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    records = _records(out)
    assert {r["TORCHELASTIC_RUN_ID"] for r in records} == {"mine"}
    assert sorted(str(r["RANK"]) for r in records) == ["0", "1"]
    for line in _inference_lines(done.stderr):
        assert "--rdzv-id" not in line and "--nnodes 2" in line


def _start_until_stopped(
    slurm: SlurmCluster, leaks: LeakCheck, tmp_path: Path, *srun_flags: str
) -> tuple[subprocess.Popen[str], str, list[dict[str, object]]]:
    job, out = _script(tmp_path, UNTIL_STOPPED)
    srun = subprocess.Popen(
        _srun(
            2, "--nproc-per-node", "2", "--shutdown-timeout", "2", job, out, srun_flags=srun_flags
        ),
        env=_env(slurm, leaks),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: len([n for n in os.listdir(out) if n.startswith("usr1.")]) == 4,
            timeout=60,
            what="four workers listening",
        )
    except BaseException:
        srun.kill()
        srun.communicate()
        raise
    return srun, out, _records(out)


@pytest.mark.timeout(150)
def test_slurm_warning_signal_stops_cleanly_and_asks_to_requeue(
    slurm: SlurmCluster, leaks: LeakCheck, tmp_path
):
    srun, out, records = _start_until_stopped(slurm, leaks, tmp_path)
    for rank in range(4):  # the agent handles SIGUSR1: its workers start with it ignored
        assert Path(out, f"usr1.{rank}").read_text() == str(signal.SIG_IGN)
    # what sbatch --signal=USR1@90 does: Slurm signals every process of the step
    slurm.run(["scancel", "--signal=USR1", f"{records[0]['SLURM_JOB_ID']}.0"])
    _, stderr = srun.communicate(timeout=60)
    assert sorted(n for n in os.listdir(out) if n.startswith("stopped.")) == [
        f"stopped.{rank}" for rank in range(4)
    ], stderr
    assert stderr.count("SIGUSR1: asking the workers to stop") == 2, stderr
    assert stderr.count("the workers stopped cleanly after the stop request") == 2, stderr
    assert srun.returncode == 128 + signal.SIGUSR1, stderr  # 138: requeue


@pytest.mark.timeout(150)
def test_a_node_killed_ends_the_step_under_kill_on_bad_exit(
    slurm: SlurmCluster, leaks: LeakCheck, tmp_path
):
    srun, _, records = _start_until_stopped(slurm, leaks, tmp_path, "--kill-on-bad-exit=1")
    victim = next(int(str(r["agent"])) for r in records if r["SLURM_NODEID"] == "1")
    os.kill(victim, signal.SIGKILL)  # node 1's relaunch dies; the guardian kills its workers
    _, stderr = srun.communicate(timeout=60)
    # Slurm ends the step: the other relaunch (and its workers) get SIGTERM, and it stops. Its
    # 143 is relaunch's own exit after that stop. Which of its lines srun forwards is a race:
    # Slurm signals the workers too, so they may be gone before relaunch would ask them to stop,
    # and srun stops forwarding once it force-terminates the step (both seen under CI's load).
    assert srun.returncode != 0, stderr
    assert "task 1: Killed" in stderr, stderr
    assert (
        "SIGTERM: asking the workers to stop" in stderr or "relaunch: stopped by SIGTERM" in stderr
    ), stderr
    assert "task 0: Exited with exit code 143" in stderr, stderr
    wait_until(lambda: not pid_alive(victim), timeout=10, what="the killed relaunch reaped")
