"""The scheduler-inference frame: which flags count as given, and how an inference is applied
and told (each scheduler's detection is tested on its own)."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import pytest

from relaunch.cli import command
from relaunch.cli.flags import build_parser, explicit_flags
from relaunch.core.schedulers import detect as schedulers
from relaunch.core.schedulers import kubernetes, mpi, slurm
from relaunch.core.schedulers.inference import Inference


def test_flags_given_on_the_command_line_or_as_pet_variables() -> None:
    argv = ["--nnodes", "2", "--nproc_per_node=4", "-r", "3", "--standalone", "train.py"]
    given = explicit_flags([*argv, "--rdzv-id", "x"], {"PET_RDZV_BACKEND": "etcd"})
    # The training script's own arguments are not relaunch's.
    assert given == {"nnodes", "nproc_per_node", "redirects", "standalone", "rdzv_backend"}
    assert explicit_flags(["train.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}) == {
        "shutdown_timeout"
    }


def test_the_line_names_each_value_and_its_variables() -> None:
    found = Inference(
        "Slurm",
        {"nnodes": (2, 2), "rdzv_id": "77.0"},
        {"nnodes": "SLURM_STEP_NUM_NODES", "rdzv_id": "SLURM_JOB_ID, SLURM_STEP_ID"},
    )
    assert found.describe(["nnodes", "rdzv_id"]) == (
        "running under Slurm: --nnodes 2 (SLURM_STEP_NUM_NODES), "
        "--rdzv-id 77.0 (SLURM_JOB_ID, SLURM_STEP_ID)"
    )
    assert found.describe([]).endswith("every setting it gives was given as a flag")


def test_explicit_flags_win_over_the_inference(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def detect(environ: Mapping[str, str]) -> Inference | None:
        if "TEST_SCHEDULER" not in environ:
            return None
        values = {"nnodes": (3, 3), "rdzv_backend": "c10d", "rdzv_id": "job9"}
        return Inference("a test scheduler", values, dict.fromkeys(values, "TEST_SCHEDULER"))

    monkeypatch.setattr(schedulers, "DETECTORS", [detect])
    argv = ["--rdzv-id", "mine", "train.py"]
    args = build_parser({}).parse_args(argv)
    command._apply_scheduler(args, argv, {"TEST_SCHEDULER": "1"})
    assert (args.nnodes, args.rdzv_backend, args.rdzv_id) == ((3, 3), "c10d", "mine")
    err = capsys.readouterr().err
    assert err == (
        "relaunch: running under a test scheduler: --nnodes 3 (TEST_SCHEDULER), "
        "--rdzv-backend c10d (TEST_SCHEDULER)\n"
    )
    args = build_parser({}).parse_args(argv)
    command._apply_scheduler(args, argv, {})  # no scheduler: nothing changes, nothing said
    assert args.nnodes == (1, 1) and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("module", "environ"),
    [
        (slurm, {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1"}),
        (slurm, {"SLURM_JOBID": "77", "SLURM_STEPID": "0", "SLURM_NODEID": "1"}),
        (kubernetes, {"JOB_COMPLETION_INDEX": "1", "RELAUNCH_SUBDOMAIN": "s", "HOSTNAME": "j-1"}),
        (mpi, {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}),
        (mpi, {"PMI_SIZE": "2", "PMI_RANK": "1"}),
    ],
)
def test_each_scheduler_module_is_asked_when_its_variables_are_set(
    module: ModuleType, environ: dict[str, str]
) -> None:
    """A scheduler's module loads only where a variable it needs is set; every environment it
    recognises has one."""
    found = module.detect(environ)
    assert found is not None and schedulers.infer(environ) == found
