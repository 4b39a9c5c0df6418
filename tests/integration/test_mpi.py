"""MPI: the real ``mpirun`` (Debian's openmpi-bin, which ``make install-test`` installs) starts
relaunch with no rendezvous flags, and the agents find each other from what it tells them.

On a cluster ``mpirun -npernode 1`` puts one relaunch on each node; here, on one machine,
``-np 2 --oversubscribe`` starts two, each MPI rank standing for a node. The pods' WORLD_SIZE
and RANK (what a PyTorchJob sets for the pod, say) must not reach the workers.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import LeakCheck

from relaunch.endpoints import find_free_port

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

# One write per line: the workers share their agent's stdout, and python -u writes print's
# pieces one by one.
JOB = """
import os
env = os.environ
os.write(1, f"worker {env['RANK']} {env['WORLD_SIZE']} {env['GROUP_RANK']}\\n".encode())
"""


@pytest.fixture
def mpirun() -> str:
    """mpirun's path; fails (never skips) without it, since CI must prove the MPI path works."""
    path = shutil.which("mpirun")
    if path is None:
        pytest.fail("mpirun is not on PATH: run `make test`, which installs Debian's openmpi-bin")
    return path


def run_mpirun(leaks: LeakCheck, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    env = leaks.process_env(
        OMPI_ALLOW_RUN_AS_ROOT="1",  # containers run tests as root; harmless otherwise
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        MASTER_PORT=str(find_free_port()),  # not 29400, which another test may hold
        WORLD_SIZE="99",
        RANK="7",
    )
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # mpirun passes it on to the agents it started
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"mpirun did not finish in 60 s:\n{out}\n{err}")
    return proc.returncode, out, err


def test_two_mpi_ranks_make_one_job_of_two_nodes(
    tmp_path: Path, mpirun: str, leaks: LeakCheck
) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    argv = [mpirun, "-np", "2", "--oversubscribe", sys.executable, "-m", "relaunch"]
    code, out, err = run_mpirun(leaks, [*argv, "--nproc-per-node", "2", "job.py"], tmp_path)
    assert code == 0, err
    workers = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("worker"))
    # Four workers, ranks 0..3 of 4, two on each of the group ranks 0 and 1.
    assert [int(rank) for rank, _, _ in workers] == [0, 1, 2, 3], out
    assert {size for _, size, _ in workers} == {"4"}
    assert sorted(group for _, _, group in workers) == ["0", "0", "1", "1"]
    # mpirun forwards both ranks' stderr, and may put one line right after the other.
    said = re.findall(r"relaunch: running under .*? \(OMPI_MCA_ess_base_jobid\)", err)
    assert len(said) == 2, err
    node_ranks = []
    for line in said:
        head, rank, rest = re.split(r"--node-rank (\d) \(OMPI_COMM_WORLD_RANK\), ", line)
        assert head == (
            "relaunch: running under Open MPI: --nnodes 2 (OMPI_COMM_WORLD_SIZE), "
            "--rdzv-backend c10d (OMPI_COMM_WORLD_SIZE), "
        ), line
        assert rest.startswith("--rdzv-endpoint "), line
        assert "(OMPI_MCA_orte_hnp_uri, MASTER_PORT), --rdzv-id " in rest, line
        node_ranks.append(rank)
    assert sorted(node_ranks) == ["0", "1"], "group ranks follow the MPI ranks"
    # Both agents agree on the endpoint and the id.
    assert said[0].split("--rdzv-endpoint")[1] == said[1].split("--rdzv-endpoint")[1]


def test_the_line_of_the_readme(tmp_path: Path, mpirun: str, leaks: LeakCheck) -> None:
    # `mpirun -npernode 1 relaunch ...`: on one machine, one node.
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    argv = [mpirun, "-npernode", "1", sys.executable, "-m", "relaunch", "job.py"]
    code, out, err = run_mpirun(leaks, argv, tmp_path)
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("worker")] == ["worker 0 1 0"]
    assert "relaunch: running under Open MPI: --nnodes 1 (OMPI_COMM_WORLD_SIZE)" in err
    assert os.environ.get("OMPI_COMM_WORLD_SIZE") is None  # the test process is no MPI rank
