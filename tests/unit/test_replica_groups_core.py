"""Replica groups decided (``core.run.replica_groups``) and derived from the flags
(``cli.args``): each group's nodes, run id, rank, environment, prefix and metrics port."""

from __future__ import annotations

import pytest

from relaunch.cli.args import GROUP_RUN_ID_ENV, GROUP_STORE_ENV, config_from_args, replica_group
from relaunch.cli.flags import build_parser
from relaunch.config import ConfigError
from relaunch.core.run import replica_groups as groups


@pytest.fixture(autouse=True)
def in_a_directory_with_a_job(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "job.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)


def parse(*argv: str):
    return build_parser({}).parse_args([*argv, "job.py"])


C10D = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "job")


def test_a_group_is_its_own_world_with_its_own_variables_and_run_id() -> None:
    assert groups.group_env(1, 3) == {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3"}
    assert groups.group_run_id("job", 2) == "job-group2"
    assert groups.group_nodes(4, 8, 2) == (2, 4)
    assert [groups.group_of_node(rank, 6, 3) for rank in range(6)] == [0, 0, 1, 1, 2, 2]
    assert groups.metrics_port(9100, 2) == 9102 and groups.metrics_port(0, 2) == 0


def test_the_worst_status_wins_and_each_end_says_how_the_group_did() -> None:
    assert groups.worst_status([0, 1, 0]) == 1 and groups.worst_status([1, 93]) == 93
    assert groups.worst_status([groups.exit_status(-9), 1]) == 137
    assert groups.format_group_end(0, 0, 0) == "replica group 0: succeeded, 0 restarts"
    assert groups.format_group_end(1, 1, 2) == "replica group 1: failed (exit status 1), 2 restarts"
    assert (
        groups.format_group_end(1, 143, 1)
        == "replica group 1: stopped (exit status 143), 1 restart"
    )
    assert (
        groups.format_group_end(2, 137, None, "SIGKILL")
        == "replica group 2: its agent was killed by SIGKILL (exit status 137)"
    )


def test_without_replica_groups_nothing_changes() -> None:
    config, _, _ = config_from_args(parse(*C10D, "--nnodes", "2"), environ={})
    assert config.run_id == "job" and config.max_nodes == 2
    assert config.log_line_prefix_template is None
    assert replica_group(parse("--standalone"), {}) is None


def test_one_node_supervises_its_groups_and_each_group_agent_follows_its_store() -> None:
    assert replica_group(parse("--standalone", "--replica-groups", "3"), {}) is None
    environ = {GROUP_STORE_ENV: "127.0.0.1:4567", GROUP_RUN_ID_ENV: "job"}
    args = parse(
        "--replica-group", "2", "--standalone", "--replica-groups", "3", "--metrics-port", "9100"
    )
    config, _, _ = config_from_args(args, environ=environ)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "127.0.0.1:4567")
    assert config.run_id == "job-group2" and config.max_nodes == 1
    assert config.rendezvous_settings.is_host is False
    assert config.metrics_endpoint.port == 9102
    assert config.log_line_prefix_template == "[g2 ${role_name}${local_rank}]:"


def test_several_nodes_form_the_groups_in_node_order() -> None:
    args = parse(*C10D, "--nnodes", "4:6", "--replica-groups", "2", "--node-rank", "4")
    config, _, _ = config_from_args(args, environ={})
    assert (config.min_nodes, config.max_nodes) == (2, 3)
    assert config.run_id == "job-group1" and config.rdzv_configs["rank"] == 1
    named = parse(*C10D, "--nnodes", "4", "--replica-groups", "2", "--replica-group", "0")
    assert config_from_args(named, environ={})[0].run_id == "job-group0"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--replica-group", "1"), "--replica-group needs --replica-groups R with R > 1"),
        (("--replica-groups", "2", "--replica-group", "2"), "is not one of --replica-groups 2"),
        ((*C10D, "--nnodes", "3", "--replica-groups", "2", "--node-rank", "0"), "cannot be split"),
        ((*C10D, "--nnodes", "4", "--replica-groups", "2"), "--replica-group G or --node-rank"),
        (("--nnodes", "2", "--replica-groups", "2", "--node-rank", "1"), "c10d or etcd"),
        ((*C10D, "--nnodes", "2", "--replica-groups", "2", "--node-rank", "5"), "--node-rank 5"),
    ],
)
def test_bad_replica_groups_are_config_errors(argv: tuple[str, ...], said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        config_from_args(parse(*argv), environ={})
