"""MPI: what one relaunch per MPI rank infers from the environment mpirun gives it.

The Open MPI environment is what Debian's Open MPI 4.1 sets (``mpirun -np 2 env``, trimmed);
the PMI one what MPICH's Hydra and Intel MPI set (``PMI_RANK``, ``PMI_SIZE``).
tests/integration/test_mpi.py runs the real mpirun.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from relaunch import config
from relaunch.core.schedulers import detect as schedulers
from relaunch.core.schedulers import mpi
from tests.support.launching import in_job_dir, launch

HNP = "1077215232.0;tcp://192.0.2.2,10.1.0.7:35645;tcp6://[fd00::2]:37323"


def open_mpi(rank: int, size: int = 2) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "OMPI_COMM_WORLD_NODE_RANK": "0",
        "OMPI_MCA_ess_base_jobid": "1077215233",
        "OMPI_MCA_orte_hnp_uri": HNP,
        "PMIX_NAMESPACE": "1077215233",
        "PMIX_RANK": str(rank),
    }


@pytest.fixture(autouse=True)
def _script(tmp_path: Path) -> Iterator[None]:
    with in_job_dir(tmp_path):
        yield


def test_every_open_mpi_rank_meets_on_the_launching_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for rank in range(3):
        got = launch(["train.py"], open_mpi(rank, size=3))
        assert (got.min_nodes, got.max_nodes, got.rdzv_backend) == (3, 3, "c10d")
        assert (got.rdzv_endpoint, got.run_id) == ("192.0.2.2:29400", "1077215233")
        assert got.rendezvous_settings.rank == rank, "group ranks follow the MPI ranks"
    assert capsys.readouterr().err.splitlines()[-1] == (
        "relaunch: running under Open MPI: --nnodes 3 (OMPI_COMM_WORLD_SIZE), --rdzv-backend c10d"
        " (OMPI_COMM_WORLD_SIZE), --node-rank 2 (OMPI_COMM_WORLD_RANK), "
        "--rdzv-endpoint 192.0.2.2:29400 (OMPI_MCA_orte_hnp_uri), "
        "--rdzv-id 1077215233 (OMPI_MCA_ess_base_jobid)"
    )


def test_master_addr_and_port_name_another_host() -> None:
    env = {**open_mpi(1), "MASTER_ADDR": "node7", "MASTER_PORT": "29999"}
    found = mpi.detect(env)
    assert found is not None
    assert found.values["rdzv_endpoint"] == "node7:29999"
    assert found.sources["rdzv_endpoint"] == "MASTER_ADDR, MASTER_PORT"
    env = {**open_mpi(1), "MASTER_ADDR": "fd00::7"}
    assert launch(["train.py"], env).rdzv_endpoint == "[fd00::7]:29400"


def test_pmi_ranks_meet_at_master_addr() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "node0"}
    found = schedulers.infer(env)
    assert found is not None and found.scheduler == "MPI (PMI)"
    got = launch(["train.py"], env)
    assert (got.max_nodes, got.rdzv_backend, got.rdzv_endpoint) == (2, "c10d", "node0:29400")


def test_pmi_with_no_host_asks_for_one_rather_than_running_apart() -> None:
    with pytest.raises(config.ConfigError, match="needs --rdzv-endpoint"):
        launch(["train.py"], {"PMI_RANK": "0", "PMI_SIZE": "2"})


def test_flags_given_win() -> None:
    argv = ["--rdzv-endpoint", "head:1234", "train.py"]
    got = launch(argv, {**open_mpi(0), "PET_NNODES": "1:2"})
    assert (got.min_nodes, got.max_nodes, got.rdzv_endpoint) == (1, 2, "head:1234")


@pytest.mark.parametrize(
    ("uri", "address"),
    [
        (HNP, "192.0.2.2"),
        ("1.0;tcp6://[fd00::2]:37323", "[fd00::2]"),
        ("1.0;tcp6://[fd00::2],[fd00::3]:37323;tcp://10.0.0.1:1", "10.0.0.1"),
        ("1.0", ""),
        ("", ""),
    ],
)
def test_the_launching_host_from_the_hnp_uri(uri: str, address: str) -> None:
    assert mpi.hnp_address(uri) == address


@pytest.mark.parametrize(
    "env",
    [
        {"OMPI_COMM_WORLD_SIZE": "2"},  # no rank
        {"OMPI_COMM_WORLD_SIZE": "0", "OMPI_COMM_WORLD_RANK": "0"},
        {"PMI_SIZE": "two", "PMI_RANK": "0"},
        {"PMIX_RANK": "0"},  # PMIx alone says no size
    ],
)
def test_no_world_no_inference(env: dict[str, str]) -> None:
    assert mpi.detect(env) is None
