"""relaunch.config: a frozen LaunchConfig, a pure mapping of flags to it (relaunch.cli.args),
one kind of error."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import textwrap
from collections.abc import Iterator, Mapping

import pytest
from conftest import LeakCheck

from relaunch import cli
from relaunch.cli.args import config_from_args, validate
from relaunch.config import ConfigError, LaunchConfig, read_rdzv_conf
from relaunch.core.rendezvous.rdzv_conf import RendezvousSettings
from relaunch.core.workers.streams import Std
from relaunch.store.etcd import EtcdStore


@pytest.fixture(autouse=True)
def in_a_directory_with_a_job(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "job.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)


def parse(*argv: str) -> object:
    return cli.build_parser({}).parse_args([*argv, "job.py"])


class _NoEnviron(Mapping[str, str]):
    """Stands in for ``os.environ``: any read fails the test."""

    def __getitem__(self, key: str) -> str:
        raise AssertionError(f"os.environ[{key!r}] was read")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("os.environ was listed")

    def __len__(self) -> int:
        raise AssertionError("os.environ was measured")


@pytest.mark.parametrize(
    "argv",
    [
        ("--nproc-per-node", "3", "--tee", "1", "--local-ranks-filter", "1"),
        ("--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"),
        ("--nnodes", "2", "--node-rank", "1", "--rdzv-conf", "join_timeout=5"),
        ("--standalone", "--nproc-per-node", "gpu"),
    ],
)
def test_config_from_args_is_pure(argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(*argv)
    first = config_from_args(args, {"PATH": "/bin"}, 2, cpus=4, fresh_run_id="r1")
    monkeypatch.setattr(os, "environ", _NoEnviron())
    second = config_from_args(args, {"PATH": "/bin"}, 2, cpus=4, fresh_run_id="r1")
    monkeypatch.undo()
    assert first == second


def test_gpus_cpus_path_and_the_standalone_run_id_are_inputs(tmp_path) -> None:
    config, _, _ = config_from_args(parse("--nproc-per-node", "gpu"), {}, 3)
    assert config.nproc_per_node == 3
    config, _, _ = config_from_args(parse("--nproc-per-node", "auto"), {}, 0, cpus=5)
    assert config.nproc_per_node == 5
    with pytest.raises(ConfigError, match="no GPU found"):
        config_from_args(parse("--nproc-per-node", "gpu"), {}, 0)
    config, _, _ = config_from_args(parse("--standalone"), {}, 0, fresh_run_id="abc")
    assert config.run_id == "abc"
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    args = cli.build_parser({}).parse_args(["--no-python", "mytool"])
    assert config_from_args(args, {"PATH": str(tool.parent)}, 0)[1] == "mytool"
    with pytest.raises(ConfigError, match="'mytool' was not found"):
        config_from_args(args, {"PATH": str(tmp_path)}, 0)


def test_launch_config_never_changes_the_callers_dicts() -> None:
    conf = {"join_timeout": "5", "password": "hunter2"}
    metrics = {"handler": "console"}
    tee = {0: Std.OUT}
    config = LaunchConfig(1, 1, 1, rdzv_configs=conf, rdzv_timeout=9, metrics_cfg=metrics, tee=tee)
    assert conf == {"join_timeout": "5", "password": "hunter2"}
    assert config.rdzv_configs == {"join_timeout": "5", "password": "hunter2", "timeout": 9}
    assert config.rdzv_configs is not conf
    assert config.metrics_cfg is not metrics and config.tee is not tee
    conf["join_timeout"] = "7"
    assert config.rdzv_configs["join_timeout"] == "5"
    assert "hunter2" not in repr(config)


def test_launch_config_is_frozen_and_replace_makes_a_changed_copy() -> None:
    config = LaunchConfig(1, 2, 4, rdzv_backend="c10d", rdzv_endpoint="h:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_restarts = 5  # type: ignore[misc]
    changed = dataclasses.replace(config, max_restarts=5)
    assert (changed.max_restarts, config.max_restarts, changed.nproc_per_node) == (5, 3, 4)
    with pytest.raises(ConfigError, match=r"nproc_per_node must be 1\.\.1024"):
        dataclasses.replace(config, nproc_per_node=0)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rdzv_backend": "zookeeper"}, "valid backends are c10d, tcp, etcd, etcd-v2, static"),
        ({"max_nodes": 2}, "needs an elastic rendezvous backend"),
        ({"rdzv_configs": {"rank": 1}}, "--node-rank 1 must be below --nnodes 1"),
        ({"rdzv_configs": {"rank": "x"}}, "rank='x': expected a whole number"),
        ({"rdzv_endpoint": "h:x"}, "has port 'x'"),
        ({"rdzv_backend": "c10d", "rdzv_endpoint": "a:1,b:x"}, "endpoint 'b:x' has port 'x'"),
        (
            {"rdzv_backend": "c10d", "rdzv_configs": {"keep_alive_interval": "0"}},
            "keep_alive_interval='0': expected a number of seconds > 0",
        ),
        ({"rdzv_backend": "etcd", "rdzv_endpoint": "ftp://h:1"}, "scheme 'ftp'"),
        ({"event_log_handler": "kafka"}, "bad event handler spec 'kafka'"),
    ],
)
def test_validate_says_what_is_wrong(overrides: dict[str, object], message: str) -> None:
    base = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 1, "rdzv_endpoint": "127.0.0.1:0"}
    config = LaunchConfig(**{**base, **overrides})
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config)


@pytest.mark.parametrize("seconds", [0, -1.0, float("inf"), float("nan")])
def test_the_exit_barrier_timeout_is_bounded(seconds: float) -> None:
    with pytest.raises(ConfigError, match="exit_barrier_timeout must be a number of seconds > 0"):
        LaunchConfig(1, 1, 1, exit_barrier_timeout=seconds)


def test_a_static_backend_ignores_the_dynamic_keys_but_join_timeout() -> None:
    validate(LaunchConfig(1, 1, 1, rdzv_endpoint="h:1", rdzv_configs={"last_call_timeout": "x"}))
    # join_timeout bounds the wait for the master's name to resolve (rendezvous.static)
    with pytest.raises(ConfigError, match="join_timeout='x'"):
        validate(LaunchConfig(1, 1, 1, rdzv_endpoint="h:1", rdzv_configs={"join_timeout": "x"}))


def test_rdzv_settings_are_typed_with_defaults() -> None:
    assert read_rdzv_conf("c10d", {}) == RendezvousSettings()
    settings = read_rdzv_conf(
        "c10d", {"join_timeout": "10", "keep_alive_max_attempt": 5, "is_host": "no", "token": "t"}
    )
    assert (settings.join_timeout, settings.keep_alive_max_attempt) == (10.0, 5)
    assert (settings.is_host, settings.token, settings.timeout) == (False, "t", 60.0)
    assert read_rdzv_conf("c10d", {"is_host": "true"}).is_host is True
    for conf, message in (
        ({"join_timeout": "x"}, "--rdzv-conf join_timeout='x': expected a number of seconds"),
        ({"keep_alive_max_attempt": "2.5"}, "keep_alive_max_attempt='2.5': expected a whole"),
        ({"keep_alive_max_attempt": "0"}, "keep_alive_max_attempt='0': expected a whole number"),
        ({"timeout": "soon"}, "timeout='soon'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_rdzv_conf("c10d", conf)


def test_etcd_options_are_the_stores_arguments(tmp_path) -> None:
    options = read_rdzv_conf(
        "etcd", {"user": "root", "password": "pw", "timeout": "5", "other": "x"}
    ).etcd_store_arguments()
    store = EtcdStore("h:1", **options)
    assert store.timeout == 5.0 and options["protocol"] == "http"
    for conf, message in (
        ({"protocol": "ftp"}, "protocol='ftp': expected http or https"),
        ({"cacert": str(tmp_path / "none.pem")}, "none.pem: no such file"),
        ({"user": "root"}, "needs both user and password"),
        ({"key": str(tmp_path / "job.py")}, "key= needs cert= too"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_rdzv_conf("etcd", conf).etcd_store_arguments()


def _main_with_a_failing_rendezvous(
    leaks: LeakCheck, error: str
) -> subprocess.CompletedProcess[str]:
    """``relaunch.cli.main`` in a fresh process whose rendezvous handler raises ``error``."""
    code = textwrap.dedent(
        f"""
        import sys
        import relaunch.launcher
        from relaunch.config import ConfigError

        def broken(config):
            raise {error}

        relaunch.launcher.rendezvous_handler = broken
        from relaunch.cli import main
        sys.exit(main(["--no-python", "true"]))
        """
    )
    return leaks.run_python(code)


def test_a_value_error_from_deep_inside_keeps_its_traceback(leaks: LeakCheck) -> None:
    done = _main_with_a_failing_rendezvous(leaks, "ValueError('a bug deep inside')")
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ValueError: a bug deep inside" in done.stderr
    assert "see relaunch --help" not in done.stderr


def test_a_config_error_from_deep_inside_is_one_line_and_exit_2(leaks: LeakCheck) -> None:
    done = _main_with_a_failing_rendezvous(leaks, "ConfigError('--rdzv-conf x=1: no good')")
    assert done.returncode == 2
    assert done.stderr == "relaunch: error: --rdzv-conf x=1: no good (see relaunch --help)\n"


@pytest.mark.parametrize(
    ("backend", "conf", "read"),
    [
        (
            "static",
            {"rank": "1", "join_timeout": "9", "timeout": "x"},
            {"rank": 1, "join_timeout": 9.0},
        ),
        (
            "c10d",
            {"rank": "3", "timeout": "5", "protocol": "ftp"},
            {"rank": 3, "timeout": 5.0, "etcd": None},
        ),
        ("etcd-v2", {"protocol": "https", "user": "u", "password": "p"}, {"timeout": 60.0}),
    ],
)
def test_each_backend_reads_its_own_rdzv_conf_keys(
    backend: str, conf: dict[str, str], read: dict[str, object]
) -> None:
    settings = LaunchConfig(1, 1, 1, rdzv_backend=backend, rdzv_configs=conf).rendezvous_settings
    assert {key: getattr(settings, key) for key in read} == read
    if backend.startswith("etcd"):
        assert settings.etcd is not None and settings.etcd.protocol == "https"
        assert "'p'" not in repr(settings)


def test_the_settings_are_read_once_and_handed_down_as_they_are() -> None:
    config = LaunchConfig(1, 2, 1, rdzv_backend="c10d", rdzv_configs={"token": "secret-t"})
    assert config.rendezvous_settings is config.rendezvous_settings
    assert config.rendezvous_settings.token == "secret-t"
    assert "secret-t" not in repr(config.rendezvous_settings)
    round_settings = config.rendezvous_settings.round_settings(1, 2)
    assert (round_settings.max_nodes, round_settings.join_timeout) == (2, 600.0)
