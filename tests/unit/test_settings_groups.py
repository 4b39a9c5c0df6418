"""The settings groups (core.settings): checked once, made of the flags' table, and kept in
step with LaunchConfig's flat fields and the agent's flat keywords."""

from __future__ import annotations

import dataclasses

import pytest

from relaunch.cli.args import settings_from_flags
from relaunch.cli.flags import FLAGS, build_parser
from relaunch.config import ConfigError, LaunchConfig
from relaunch.core.run.restart import Backoff
from relaunch.core.run.settings import (
    GROUPS,
    HangSettings,
    HealthSettings,
    MetricsEndpoint,
    RestartPolicy,
    agent_groups,
)


def test_every_row_names_a_config_field_or_a_group_field() -> None:
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    for flag in FLAGS:
        if flag.field is None:
            continue
        group, _, name = flag.field.rpartition(".")
        if group:
            assert name in GROUPS[group][0].__slots__, flag.names
        else:
            assert name in names, flag.names


def test_the_flags_make_the_groups() -> None:
    args = build_parser({}).parse_args(
        ["--hang-timeout", "5", "--restart-backoff", "2:10", "--health-check", "true", "x.py"]
    )
    keywords = settings_from_flags(args)
    assert keywords["hang"] == HangSettings(timeout=5.0)
    assert keywords["restart_policy"] == RestartPolicy(backoff=(2.0, 10.0))
    assert keywords["health"] == HealthSettings(command="true")
    assert "timers" not in keywords and "hang_timeout" not in keywords


def test_flat_fields_and_groups_agree() -> None:
    config = LaunchConfig(1, 1, 2, hang_timeout=60, metrics_port=0)
    assert config.hang == HangSettings(timeout=60) and config.metrics_endpoint.port == 0
    assert dataclasses.replace(config, hang_timeout=5).hang.timeout == 5
    grouped = LaunchConfig(1, 1, 2, health=HealthSettings("true", cooldown=2.0))
    assert (grouped.health_check, grouped.health_check_cooldown) == ("true", 2.0)
    assert "health=" not in repr(grouped)


def test_a_group_is_checked_once() -> None:
    with pytest.raises(ConfigError, match="hang_timeout must be"):
        LaunchConfig(1, 1, 2, hang_timeout=-1)
    with pytest.raises(ValueError, match="metrics_port must be a port"):
        MetricsEndpoint(port=70000)


def test_the_agents_flat_keywords_make_its_groups() -> None:
    flat = {
        "restart_backoff": Backoff(2.0, 8.0, 20.0),
        "max_stalled_restarts": 3,
        "hang_timeout": None,
        "timers": None,
        "straggler_factor": 1.5,
        "health_check": None,
        "metrics_host": "",
        "metrics_port": None,
    }
    restart, hang, health, endpoint = agent_groups((None, None, None, None), flat)
    assert restart.rule == Backoff(2.0, 8.0, 20.0) and RestartPolicy().rule == Backoff()
    assert (hang, health, endpoint) == (HangSettings(), HealthSettings(), MetricsEndpoint())
    with pytest.raises(TypeError, match="not both"):
        agent_groups((RestartPolicy(), None, None, None), flat)
