"""The CLI's value parsers and its mapping of flags to a LaunchConfig, without processes."""

from __future__ import annotations

import argparse
import signal
import sys
import uuid

import pytest

from relaunch import cli
from relaunch.config import ConfigError
from relaunch.core.workers.streams import Std


@pytest.fixture(autouse=True)
def in_a_directory_with_a_job(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "job.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize(("text", "nodes"), [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4))])
def test_nnodes(text: str, nodes: tuple[int, int]) -> None:
    assert cli.parse_nnodes(text) == nodes


@pytest.mark.parametrize("text", ["0", "two", "3:1", "1:2:3", "-1", ":2", ""])
def test_bad_nnodes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_nnodes(text)


def test_rdzv_conf() -> None:
    assert cli.parse_rdzv_conf("join_timeout=10, is_host=true,") == {
        "join_timeout": "10",
        "is_host": "true",
    }
    assert cli.parse_rdzv_conf("") == {}
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_rdzv_conf("timeout")


@pytest.mark.parametrize(
    ("env", "count"),
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1,3"}, 3),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
    ],
)
def test_gpus_are_counted_from_cuda_visible_devices(env: dict[str, str], count: int) -> None:
    assert cli.count_gpus(env) == count


def test_nproc_gpu_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert cli.resolve_nproc("gpu") == 2
    assert cli.resolve_nproc("auto") == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="no GPU found"):
        cli.resolve_nproc("gpu")
    assert cli.resolve_nproc("auto") >= 1
    assert cli.resolve_nproc("7") == 7


def parse(*argv: str, **env: str) -> argparse.Namespace:
    return cli.build_parser(dict(env)).parse_args([*argv, "job.py"])


def test_every_flag_has_both_spellings_and_a_pet_variable() -> None:
    for flag in cli.FLAGS:
        long_name = flag.names[-1]
        dest = long_name.lstrip("-").replace("-", "_")
        underscored = "--" + long_name[2:].replace("-", "_")
        value = (
            "1"
            if flag.switch
            else {
                "nnodes": "2",
                "nproc_per_node": "3",
                "rdzv_conf": "a=b",
                "redirects": "1",
                "tee": "2",
                "local_ranks_filter": "0",
                "signals_to_handle": "SIGTERM",
                "start_method": "fork",
                "rdzv_endpoint": "h:1",
                "monitor_interval": "0.5",
                "shutdown_timeout": "2",
                "max_restarts": "4",
                "node_rank": "1",
                "replica_groups": "2",
                "replica_group": "1",
                "master_port": "9",
                "hang_timeout": "30",
                "exit_barrier_timeout": "12.5",
                "health_check_timeout": "7",
                "health_check_cooldown": "9",
                "restart_backoff": "2:8",
                "max_stalled_restarts": "0",
                "straggler_factor": "3",
                "evict_stragglers": "30",
                "metrics_port": "9100",
                "numa_binding": "socket",
                "logs_specs": "default",
                "duplicate_stdout_filters": "a,,b,c",
                "duplicate_stderr_filters": "d",
                "state_memory": "8G",
                "state_persist_every": "3",
                "state_replicas": "2",
                "state_copy_every": "4",
                "jit_save_timeout": "2.5",
            }.get(dest, "x")
        )
        argv = [underscored] if flag.switch else [f"{underscored}={value}"]
        from_flag = getattr(parse(*argv), dest)
        from_env = getattr(parse(**{f"PET_{dest.upper()}": value}), dest)
        assert from_flag == from_env, long_name
        assert from_flag != getattr(parse(), dest), long_name


def test_standalone_picks_a_fresh_run_id_and_a_free_port() -> None:
    config, entrypoint, args = cli.config_from_args(parse("--standalone", "--nproc-per-node", "2"))
    assert entrypoint == sys.executable and args == ("-u", "job.py")
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "127.0.0.1:0"
    assert config.rdzv_configs == {"is_host": "true"}
    assert str(uuid.UUID(config.run_id, version=4)) == config.run_id  # torchrun's uuid4 text
    assert config.nproc_per_node == 2


def test_one_node_without_a_master_port_gets_a_fresh_run_id_as_under_torchrun() -> None:
    fresh = cli.config_from_args(parse("--rdzv-id", "mine"))[0]
    assert fresh.rdzv_backend == "static" and fresh.rdzv_endpoint == "127.0.0.1:0"
    assert str(uuid.UUID(fresh.run_id, version=4)) == fresh.run_id  # torchrun ignores --rdzv-id
    kept = cli.config_from_args(parse("--master-port", "29511", "--rdzv-id", "mine"))[0]
    assert (kept.rdzv_backend, kept.rdzv_endpoint) == ("static", "127.0.0.1:29511")
    assert kept.run_id == "mine"
    two = cli.config_from_args(parse("--nnodes", "2"))[0]
    assert two.run_id == "none" and two.rdzv_endpoint == "127.0.0.1:29500"


def test_static_multi_node_uses_master_addr_and_port() -> None:
    argv = ("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.1.1")
    config, _, _ = cli.config_from_args(parse(*argv))
    assert config.rdzv_endpoint == "10.1.1.1:29500"
    assert config.rdzv_configs == {"rank": 1}


def test_local_ranks_filter_is_torchs_filter() -> None:
    config, _, _ = cli.config_from_args(
        parse("--nproc-per-node", "3", "--tee", "1", "--local-ranks-filter", "1")
    )
    # As torchrun: the streams stay as given, the filter goes with them (DefaultLogsSpecs').
    assert (config.tee, config.redirects) == (Std.OUT, Std.NONE)
    assert config.local_ranks_filter == frozenset({1})


def test_signals_to_handle() -> None:
    assert parse("--signals-to-handle", "SIGTERM,int,15").signals_to_handle == [
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGTERM,
    ]


def test_torchruns_shutdown_timeout_variable_sets_the_default() -> None:
    def timeout(**env: str) -> float:
        return float(cli.build_parser(env).parse_args(["job.py"]).shutdown_timeout)

    assert timeout() == 30.0
    assert timeout(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="7") == 7.0
    assert timeout(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="7", PET_SHUTDOWN_TIMEOUT="9") == 9.0
    parser = cli.build_parser({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"})
    assert parser.parse_args(["--shutdown-timeout", "3", "job.py"]).shutdown_timeout == 3.0


def test_the_exit_barrier_timeout_is_a_flag_a_variable_and_a_config_field() -> None:
    assert parse().exit_barrier_timeout == 300.0
    assert parse("--exit-barrier-timeout", "2.5").exit_barrier_timeout == 2.5
    assert parse(PET_EXIT_BARRIER_TIMEOUT="4").exit_barrier_timeout == 4.0
    config, _, _ = cli.config_from_args(parse("--exit-barrier-timeout", "7"))
    assert config.exit_barrier_timeout == 7.0
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(ConfigError, match="--exit-barrier-timeout") as caught:
            cli.config_from_args(parse("--exit-barrier-timeout", bad))
        assert "\n" not in str(caught.value)


def test_torchruns_python_exec_runs_the_script(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relaunch.cli.args import config_from_args

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").touch()
    monkeypatch.chdir(tmp_path)  # where the workers find pkg: -m of one not found is refused
    args = cli.build_parser({}).parse_args(["-m", "pkg.main"])
    assert config_from_args(args, {"PYTHON_EXEC": "/opt/py"}, 0)[1:] == (
        "/opt/py",
        ("-u", "-m", "pkg.main"),
    )
    assert config_from_args(args, {}, 0)[1] == sys.executable


@pytest.mark.parametrize(
    ("text", "cpus", "gpus", "canonical", "workers"),
    [
        ("007", 4, 0, "7", 7),
        ("cpu", 4, 2, "cpu", 4),
        ("gpu", 4, 2, "gpu", 2),
        ("auto", 4, 0, "auto", 4),
        ("gpu:3,0-1", 4, 4, "gpu:3,0,1", 3),
    ],
)
def test_nproc_per_node_is_read_once_into_a_device_request(
    text: str, cpus: int, gpus: int, canonical: str, workers: int
) -> None:
    from relaunch.cli.args import parse_device_request

    request = parse_device_request(text)
    assert (str(request), request.workers(cpus, gpus)) == (canonical, workers)
    assert request.counts_gpus == (text in ("gpu", "auto") or text.startswith("gpu:"))
