"""The Slurm inference: hostlist expressions, and what a step's environment tells."""

from __future__ import annotations

import signal

import pytest

from relaunch.cli.values import parse_signals
from relaunch.core.schedulers import slurm
from relaunch.core.schedulers.detect import infer
from relaunch.core.schedulers.slurm import detect, expand_hostlist, first_host, node_address


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("rack1-n[7,9]-ib", ["rack1-n7-ib", "rack1-n9-ib"]),
        ("x[2],y", ["x2", "y"]),
        ("a.example.com,b[1-2].example.com", ["a.example.com", "b1.example.com", "b2.example.com"]),
        ("", []),
    ],
)
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["n[1-3", "n1-3]", "n[[1]]", "n[3-1]", "n[a-b]", "n[1:2]"])
def test_malformed_hostlists_are_refused(expr: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(expr)
    assert first_host(expr) == ""


def test_node_aliases_give_an_address() -> None:
    aliases = "ec0:10.0.0.2:ip-10-0-0-2,ec1:[fe80::1]:ip6"
    assert node_address("ec0", aliases) == "10.0.0.2"
    assert node_address("ec1", aliases) == "[fe80::1]"
    assert node_address("ec2", aliases) == "ec2"
    assert node_address("n1", "") == "n1"


def step(**extra: str) -> dict[str, str]:
    """A task's environment in ``srun -N2 --ntasks-per-node=1`` (as Slurm 22.05 sets it)."""
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_JOBID": "1234",
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "SLURM_JOB_NODELIST": "gpu[01-04,07],cpu3",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
        "SLURM_JOB_NUM_NODES": "6",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    return {**env, **extra}


def test_a_step_task_tells_the_job() -> None:
    found = detect(step())
    assert found is not None
    assert found.scheduler == "Slurm (job 1234, step 0)"
    assert found.values == {
        "nnodes": (2, 2),
        "node_rank": 1,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "gpu03:29740",  # 29400 + (10 * 1234 + 0) % 1000
        "rdzv_id": "1234.0",
        "signals_to_handle": slurm.SIGNALS,
    }
    assert found.sources["nnodes"] == "SLURM_STEP_NUM_NODES"
    assert found.sources["node_rank"] == "SLURM_NODEID"
    assert found.sources["rdzv_endpoint"] == "SLURM_STEP_NODELIST, SLURM_JOB_ID, SLURM_STEP_ID"
    assert found.sources["rdzv_id"] == "SLURM_JOB_ID, SLURM_STEP_ID"
    assert infer(step()) == found  # asked first


def test_the_signals_are_the_default_and_slurms_warning() -> None:
    from relaunch.cli.flags_job import DEFAULT_SIGNALS

    assert [*parse_signals(DEFAULT_SIGNALS), signal.SIGUSR1] == slurm.SIGNALS
    line = detect(step())
    assert line is not None
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 (" in line.describe(
        ["signals_to_handle"]
    )


def test_steps_of_one_job_and_jobs_differ_in_port() -> None:
    ports = set()
    for job, step_id in [("1234", "0"), ("1234", "1"), ("1235", "0")]:
        found = detect(step(SLURM_JOB_ID=job, SLURM_STEP_ID=step_id))
        assert found is not None
        ports.add(found.values["rdzv_endpoint"].rsplit(":", 1)[1])
    assert len(ports) == 3
    assert all(29400 <= int(port) < 30400 for port in ports)


def test_master_addr_and_port_win_and_the_job_list_serves_without_a_step_list() -> None:
    found = detect(step(MASTER_ADDR="10.1.2.3", MASTER_PORT="6000"))
    assert found is not None
    assert found.values["rdzv_endpoint"] == "10.1.2.3:6000"
    assert found.sources["rdzv_endpoint"] == "MASTER_ADDR, MASTER_PORT"
    env = step()
    del env["SLURM_STEP_NODELIST"]
    found = detect(env)
    assert found is not None
    assert found.values["rdzv_endpoint"].startswith("gpu01:")
    env["SLURM_JOB_NODELIST"] = "n[1-"
    found = detect(env)
    assert found is not None and "rdzv_endpoint" not in found.values  # no host: not guessed


def test_node_aliases_address_the_first_node() -> None:
    found = detect(step(SLURM_NODE_ALIASES="gpu03:10.0.0.3:h3,gpu04:10.0.0.4:h4"))
    assert found is not None
    assert found.values["rdzv_endpoint"] == "10.0.0.3:29740"
    assert "SLURM_NODE_ALIASES" in found.sources["rdzv_endpoint"]


@pytest.mark.parametrize(
    ("extra", "gpus", "variable"),
    [
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_STEP_GPUS": "0,1"}, "4", "SLURM_GPUS_ON_NODE"),
        ({"SLURM_STEP_GPUS": "0,1,2"}, "3", "SLURM_STEP_GPUS"),
        ({"SLURM_JOB_GPUS": "5,7"}, "2", "SLURM_JOB_GPUS"),
    ],
)
def test_workers_per_node_are_the_gpus_slurm_gave(
    extra: dict[str, str], gpus: str, variable: str
) -> None:
    found = detect(step(**extra))
    assert found is not None
    assert found.values["nproc_per_node"] == gpus
    assert found.sources["nproc_per_node"] == variable


def test_no_gpus_infers_no_workers_per_node() -> None:
    found = detect(step(SLURM_GPUS_ON_NODE="0", SLURM_CPUS_ON_NODE="16"))
    assert found is not None and "nproc_per_node" not in found.values


def test_several_tasks_per_node_make_each_task_an_agent() -> None:
    env = step(SLURM_STEP_NUM_TASKS="8", SLURM_PROCID="5", SLURM_GPUS_ON_NODE="4")
    found = detect(env)
    assert found is not None
    assert found.values["nnodes"] == (8, 8)
    assert found.values["node_rank"] == 5
    assert "SLURM_STEP_NUM_TASKS" in found.sources["nnodes"]
    assert "nproc_per_node" not in found.values  # the node's GPUs are shared by its tasks


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_JOB_ID": "1234", "SLURM_NODEID": "0"},  # a batch script or salloc shell
        {k: v for k, v in step().items() if k not in ("SLURM_NODEID",)},
        step(SLURM_STEP_ID="4294967294", SLURM_STEPID="4294967294"),  # the batch step
        step(SLURM_JOB_ID="abc", SLURM_JOBID="abc"),
    ],
)
def test_nothing_is_inferred_outside_a_step(env: dict[str, str]) -> None:
    assert detect(env) is None


def test_old_spellings_serve() -> None:
    env = {k: v for k, v in step().items() if k not in ("SLURM_JOB_ID", "SLURM_STEP_ID")}
    found = detect(env)
    assert found is not None
    assert found.values["rdzv_id"] == "1234.0"
    assert found.sources["rdzv_id"] == "SLURM_JOBID, SLURM_STEPID"


@pytest.mark.parametrize(
    ("argv", "nproc", "rdzv_id"),
    [
        (["train.py"], "4", "1234.0"),  # not given: Slurm's GPUs
        (["--nproc-per-node", "auto", "train.py"], "4", "1234.0"),  # auto: Slurm's GPUs too
        (["--nproc-per-node", "2", "--rdzv-id", "mine", "train.py"], "2", "mine"),  # flags win
    ],
)
def test_the_cli_applies_what_is_not_given(
    argv: list[str], nproc: str, rdzv_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from relaunch.cli.command import _apply_scheduler
    from relaunch.cli.flags import build_parser

    args = build_parser().parse_args(argv)
    _apply_scheduler(args, argv, step(SLURM_GPUS_ON_NODE="4"))
    assert (args.nproc_per_node, args.rdzv_id) == (nproc, rdzv_id)
    assert args.signals_to_handle[-1] == signal.SIGUSR1
    line = capsys.readouterr().err
    assert line.startswith("relaunch: running under Slurm (job 1234, step 0): --nnodes 2")
    assert ("--nproc-per-node 4 (SLURM_GPUS_ON_NODE)" in line) == (nproc == "4")
