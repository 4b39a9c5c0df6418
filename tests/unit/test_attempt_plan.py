"""The plan of an attempt: every rank's environment, arguments, I/O, prefixes and CPUs, decided
before anything starts (``core.workers.attempt``), as the agent passes it to ``start_processes``."""

from __future__ import annotations

import pytest

from relaunch.core.workers.attempt import AttemptPlan, Command, plan_attempt
from relaunch.core.workers.placement import Placement, RankPlacement
from relaunch.core.workers.ranks import GroupContext, assign_ranks
from relaunch.core.workers.streams import Std

COMMAND = Command(
    role="trainer",
    entrypoint="/usr/bin/python3",
    args=("-u", "train.py", "--rank=${local_rank}"),
    nprocs=2,
    start_method="spawn",
    shutdown_timeout=7.0,
)
GROUP = GroupContext(
    role="trainer",
    run_id="job7",
    group_rank=1,
    group_world_size=2,
    local_world_size=2,
    master_addr="10.0.0.1",
    master_port=29500,
    restart_count=1,
    max_restarts=3,
)
RANKS = assign_ranks([2, 2], 1)  # global ranks 2 and 3


def plan(command: Command = COMMAND, environ: dict[str, str] | None = None, **kw) -> AttemptPlan:
    return plan_attempt(command, GROUP, RANKS, environ or {}, "/logs/attempt_1", **kw)


def test_the_plan_is_what_start_processes_is_given() -> None:
    attempt = plan(extra_env={"RELAUNCH_CHANNEL": "/dev/shm/x"})
    arguments = attempt.start_arguments()
    assert set(arguments) == {
        "name",
        "entrypoint",
        "args",
        "envs",
        "log_dir",
        "start_method",
        "redirects",
        "tee",
        "shutdown_timeout",
        "log_line_prefixes",
    }  # no relay and no CPUs: a start_processes of torch's knows neither
    assert arguments["args"] == {0: COMMAND.args, 1: COMMAND.args}
    assert arguments["log_dir"] == "/logs/attempt_1"
    assert arguments["shutdown_timeout"] == 7.0 and arguments["log_line_prefixes"] == {}
    env = arguments["envs"][1]
    assert (env["LOCAL_RANK"], env["RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == (
        "1",
        "3",
        "1",
        "4",
    )
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1" and env["MASTER_PORT"] == "29500"
    assert env["RELAUNCH_CHANNEL"] == "/dev/shm/x" and env["OMP_NUM_THREADS"] == "1"
    assert attempt.rank_args(1) == ("-u", "train.py", "--rank=1")


def test_placement_and_the_agents_variables_come_after_torchruns() -> None:
    placement = Placement(
        (
            RankPlacement({"CUDA_VISIBLE_DEVICES": "4", "OMP_NUM_THREADS": "6"}, frozenset({0, 1})),
            RankPlacement({"CUDA_VISIBLE_DEVICES": "5"}),
        )
    )
    attempt = plan(placement=placement, extra_env={"CUDA_VISIBLE_DEVICES": "7"})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in attempt.envs.values()] == ["7", "7"]
    assert attempt.envs[0]["OMP_NUM_THREADS"] == "6"  # the placement's, over torchrun's default
    assert attempt.start_arguments()["cpu_affinity"] == {0: frozenset({0, 1})}


def test_line_prefixes_follow_torchruns_template_with_global_ranks() -> None:
    template = "[${role_name} ${rank}/${local_rank}]"
    command = COMMAND._replace(log_line_prefix_template=template)
    assert plan(command).log_line_prefixes == {0: "[trainer 2/0]", 1: "[trainer 3/1]"}
    assert plan(command).rank_io()[1].prefix == "[trainer 3/1]"
    # torch's agent takes the template as an argument: the variable is torchrun's to read.
    environ = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": template}
    assert plan(environ=environ).log_line_prefixes == {}


@pytest.mark.parametrize(
    ("nprocs", "redirects", "terminals", "hang", "tee", "relay", "draws"),
    [
        # On a terminal: the workers write to it themselves.
        (2, Std.NONE, Std.ALL, False, Std.NONE, {0: Std.NONE, 1: Std.NONE}, False),
        # Several workers on a pipe: relaunch copies their lines, byte for byte: no bar there.
        (2, Std.NONE, Std.NONE, False, Std.NONE, {0: Std.ALL, 1: Std.ALL}, False),
        # One worker on a pipe: its streams are its own, as under torchrun.
        (1, Std.NONE, Std.NONE, False, Std.NONE, {0: Std.NONE}, False),
        # Hang detection reads every stream: a terminal's tee'd, a pipe's relayed.
        (1, Std.NONE, Std.ERR, True, {0: Std.ERR}, {0: Std.OUT}, True),
        # Every stream redirected to files: the console is relaunch's.
        (2, Std.ALL, Std.ALL, False, Std.NONE, {0: Std.NONE, 1: Std.NONE}, True),
    ],
)
def test_where_the_workers_output_goes(
    nprocs: int,
    redirects: Std,
    terminals: Std,
    hang: bool,
    tee: object,
    relay: dict[int, Std],
    draws: bool,
) -> None:
    command = Command("trainer", "/bin/true", (), nprocs, redirects=redirects)
    attempt = plan_attempt(
        command,
        GROUP,
        assign_ranks([nprocs], 0),
        {},
        "/logs/attempt_0",
        terminals=terminals,
        hang_detection=hang,
    )
    assert (attempt.tee, attempt.relay, attempt.draws_console) == (tee, relay, draws)
    assert ("relay" in attempt.start_arguments()) == any(relay.values())


def test_the_plan_names_each_ranks_files() -> None:
    command = Command("trainer", "/bin/true", (), 2, redirects={0: Std.OUT}, tee={1: Std.ERR})
    io = plan(command).rank_io()
    assert (io[0].stdout, io[0].stderr) == ("/logs/attempt_1/0/stdout.log", "")
    assert (io[1].stdout, io[1].stderr, io[1].tee) == ("", "/logs/attempt_1/1/stderr.log", Std.ERR)


def test_a_dry_run_of_one_static_node_knows_every_rank() -> None:
    from relaunch.agent.dry_run import AT_THE_JOIN, first_attempt
    from relaunch.config import LaunchConfig

    config = LaunchConfig(
        min_nodes=2,
        max_nodes=2,
        nproc_per_node=2,
        run_id="job7",
        rdzv_backend="static",
        rdzv_endpoint="10.0.0.1:29500",
        rdzv_configs={"rank": 1},
    )
    first = first_attempt(config, "/usr/bin/python3", ["train.py"], environ={})
    assert first.stopped_before == ""
    env = first.plan.envs[1]
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("3", "4", "10.0.0.1")
    assert AT_THE_JOIN not in env.values()


def test_a_dry_run_of_an_elastic_rendezvous_stops_before_joining() -> None:
    from relaunch.agent.dry_run import AT_THE_JOIN, dry_run
    from relaunch.config import LaunchConfig

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=3,
        nproc_per_node=2,
        run_id="job7",
        rdzv_backend="c10d",
        rdzv_endpoint="head:29400",
    )
    text = dry_run(config, "/usr/bin/python3", ["train.py", "--rank=${local_rank}"], environ={})
    assert "command: /usr/bin/python3 train.py --rank=1" in text
    assert f"RANK={AT_THE_JOIN}" in text and "LOCAL_RANK=1" in text
    assert text.endswith(
        "stopped before joining the rendezvous (the join gives RANK, GROUP_RANK, "
        "ROLE_RANK, WORLD_SIZE, GROUP_WORLD_SIZE, ROLE_WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT, TORCHELASTIC_RESTART_COUNT)\n"
    )
