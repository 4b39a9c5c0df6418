"""torch 2.13's ``WorkerSpec`` and ``LaunchConfig`` fields through relaunch, beside torch.

A torch program builds both with torch's arguments unchanged: ``fn`` (deprecated, warned, the
entrypoint), ``event_log_handler`` (where the agent records its events), ``numa_options`` (as
relaunch's NUMA binding), ``virtual_local_rank`` (``LOCAL_RANK=0``, one GPU each),
``shutdown_timeout=None`` and a rendezvous backend the user registered.
"""

from __future__ import annotations

import dataclasses
import json
import types
import warnings
from typing import Any

import compat_spec_fields_fns as fns
import pytest
from conftest import MARK_VAR, LeakCheck

from relaunch import LaunchConfig, LocalElasticAgent, WorkerSpec, elastic_launch
from relaunch.config import ConfigError
from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT
from relaunch.events import JsonLinesEventHandler
from relaunch.rendezvous import (
    RendezvousParameters,
    StaticRendezvousHandler,
    rendezvous_handler_registry,
)

pytestmark = pytest.mark.xdist_group("torch")

torch = pytest.importorskip("torch")
torch_api = pytest.importorskip("torch.distributed.elastic.agent.server.api")
torch_launcher = pytest.importorskip("torch.distributed.launcher.api")
numa = pytest.importorskip("torch.numa.binding")

#: A backend name only this module registers.
MY_BACKEND = "compat-spec-fields-static"


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch, leaks: LeakCheck) -> LeakCheck:
    """Workers spawned from this process carry the leak mark."""
    monkeypatch.setenv(MARK_VAR, leaks.mark)
    return leaks


def handler(run_id: str = "spec-fields") -> StaticRendezvousHandler:
    return StaticRendezvousHandler(run_id, 0, 1, "127.0.0.1", 0)


def torch_only_fields() -> dict[str, Any]:
    """Every field torch 2.13's WorkerSpec has and the seeds' did not."""
    return {
        "event_log_handler": "console",
        "numa_options": numa.NumaOptions(affinity_mode=numa.AffinityMode.SOCKET),
        "duplicate_stdout_filters": ["loss"],
        "duplicate_stderr_filters": ["warn"],
        "virtual_local_rank": True,
    }


def spec_fields(spec: Any) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(torch_api.WorkerSpec)}


# -- construction, side by side --------------------------------------------------------------


def test_worker_spec_takes_torchs_fields_as_torch_does() -> None:
    rdzv = handler()
    with pytest.warns(DeprecationWarning, match="entrypoint") as theirs_warned:
        theirs = torch_api.WorkerSpec("trainer", 2, rdzv, fns.device_env, **torch_only_fields())
    with pytest.warns(DeprecationWarning, match="entrypoint") as mine_warned:
        mine = WorkerSpec("trainer", 2, rdzv, fns.device_env, **torch_only_fields())
    assert len(mine_warned) == len(theirs_warned) == 1
    # relaunch's points at the caller's line (torch's at the dataclass' generated __init__).
    assert [w.filename for w in mine_warned] == [__file__]
    assert spec_fields(mine) == spec_fields(theirs)
    assert mine.entrypoint is theirs.entrypoint is fns.device_env
    assert (mine.redirects, mine.tee, mine.shutdown_timeout) == (0, 0, DEFAULT_SHUTDOWN_TIMEOUT)


def test_worker_spec_defaults_and_positions_are_torchs() -> None:
    rdzv = handler()
    positional = ("r", 1, rdzv, None, "/bin/true", ("-x",), 2, 0.5, 29511, "127.0.0.1", "::1")
    theirs = torch_api.WorkerSpec(*positional)
    mine = WorkerSpec(*positional)
    assert spec_fields(mine) == spec_fields(theirs)
    assert (mine.event_log_handler, mine.numa_options, mine.virtual_local_rank) == (
        "null",
        None,
        False,
    )


def test_the_seeds_positional_entrypoint_and_args_say_to_use_keywords() -> None:
    """relaunch's old order (role, local_world_size, rdzv_handler, entrypoint, args): torch
    would take the entrypoint as fn and drop the args silently; relaunch says so in one line."""
    with pytest.raises(ValueError, match=r"4th field is fn .*entrypoint= and args= by keyword"):
        WorkerSpec("r", 1, handler(), fns.device_env, ("a",))


def test_launch_config_takes_torchs_fields_and_defaults() -> None:
    given = {
        "numa_options": numa.NumaOptions(affinity_mode=numa.AffinityMode.EXCLUSIVE),
        "virtual_local_rank": True,
        "shutdown_timeout": None,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "127.0.0.1:0",
    }
    theirs = torch_launcher.LaunchConfig(1, 1, 2, **given)
    mine = LaunchConfig(1, 1, 2, **given)
    for name in ("numa_options", "virtual_local_rank", "role", "rdzv_backend"):
        assert getattr(mine, name) == getattr(theirs, name), name
    assert mine.role == "default_role"
    assert mine.numa_binding == "exclusive"  # relaunch's NUMA binding of the same mode
    assert mine.shutdown_timeout == DEFAULT_SHUTDOWN_TIMEOUT  # None: relaunch's default
    # What relaunch keeps its own: the static backend by default (torch's etcd needs a server).
    assert LaunchConfig(1, 1, 1).rdzv_backend == "static"


@pytest.mark.parametrize("mode", list(numa.AffinityMode))
def test_every_torch_numa_mode_maps(mode: Any) -> None:
    options = numa.NumaOptions(affinity_mode=mode)
    assert LaunchConfig(1, 1, 1, numa_options=options).numa_binding == mode.value
    assert WorkerSpec("r", 1, handler(), entrypoint="true", numa_options=options).numa_options


def test_numa_options_relaunch_cannot_bind_fail_in_one_line() -> None:
    odd = types.SimpleNamespace(affinity_mode="gpu-local")
    with pytest.raises(ConfigError, match="affinity_mode 'gpu-local' has no relaunch NUMA") as e:
        LaunchConfig(1, 1, 1, numa_options=odd)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="expected one of node, socket, exclusive"):
        WorkerSpec("r", 1, handler(), entrypoint="true", numa_options=odd)
    node = numa.NumaOptions(affinity_mode=numa.AffinityMode.NODE)
    with pytest.raises(ConfigError, match="give one of them"):
        LaunchConfig(1, 1, 1, numa_options=node, numa_binding="socket")


# -- virtual local ranks, side by side --------------------------------------------------------


def launch_config(run_id: str, **overrides: Any) -> dict[str, Any]:
    return {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 2,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "127.0.0.1:0",
        "run_id": run_id,
        "max_restarts": 0,
        "monitor_interval": 0.1,
        **overrides,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inherited", [None, "5,7"])
def test_virtual_local_rank_gives_what_torch_gives(
    inherited: str | None, marked, monkeypatch: pytest.MonkeyPatch
) -> None:
    if inherited is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", inherited)
    # torch's workers forked: they import no torch of their own, and see the same variables
    config = launch_config("t-virtual", virtual_local_rank=True, start_method="fork")
    theirs = torch_launcher.elastic_launch(torch_launcher.LaunchConfig(**config), fns.device_env)()
    mine = elastic_launch(
        LaunchConfig(**launch_config("r-virtual", virtual_local_rank=True)), fns.device_env
    )()
    devices = (inherited or "0,1").split(",")
    assert mine == theirs == {0: ("0", "0", devices[0]), 1: ("1", "0", devices[1])}


@pytest.mark.timeout(60)
def test_virtual_local_rank_with_too_few_inherited_gpus_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"local rank 1 exceeds .*CUDA_VISIBLE_DEVICES=3"):
        elastic_launch(
            LaunchConfig(**launch_config("r-few", virtual_local_rank=True)), fns.device_env
        )()


@pytest.mark.timeout(60)
def test_a_worker_spec_with_virtual_local_rank_runs_through_the_agent(
    marked, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """torch's recipe (a WorkerSpec and LocalElasticAgent, no LaunchConfig) honours it too."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,6")
    spec = WorkerSpec(
        "trainer", 2, handler("virtual-agent"), entrypoint=fns.device_env, max_restarts=0,
        virtual_local_rank=True,
    )  # fmt: skip
    result = LocalElasticAgent(spec, log_dir=str(tmp_path)).run()
    assert result.return_values == {0: ("0", "0", "2"), 1: ("1", "0", "6")}


# -- event_log_handler ------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_event_log_handler_console_records_the_agents_events(
    marked, tmp_path, capfd: pytest.CaptureFixture[str]
) -> None:
    spec = WorkerSpec(
        "trainer", 2, handler("events-console"), entrypoint=fns.rank_squared, max_restarts=0,
        event_log_handler="console",
    )  # fmt: skip
    result = LocalElasticAgent(spec, log_dir=str(tmp_path)).run()
    assert result.return_values == {0: 0, 1: 1}
    events = [json.loads(line) for line in capfd.readouterr().err.splitlines() if '"name"' in line]
    names = [(e["source"], e["name"]) for e in events]
    assert names[-1] == ("AGENT", "torchelastic.worker.status.SUCCEEDED")
    assert names.count(("WORKER", "torchelastic.worker.status.SUCCEEDED")) == 2
    assert {e["metadata"]["run_id"] for e in events} == {"events-console"}


@pytest.mark.timeout(60)
def test_the_agents_own_event_handler_wins_over_event_log_handler(marked, tmp_path) -> None:
    sink = JsonLinesEventHandler(tmp_path / "events.jsonl")
    spec = WorkerSpec(
        "trainer", 1, handler("events-own"), entrypoint=fns.rank_squared, max_restarts=0,
        event_log_handler=f"file:{tmp_path / 'not-used.jsonl'}",
    )  # fmt: skip
    LocalElasticAgent(spec, log_dir=str(tmp_path / "logs"), event_handler=sink).run()
    sink.close()
    assert (tmp_path / "events.jsonl").read_text().count("torchelastic.worker.status") >= 2
    assert not (tmp_path / "not-used.jsonl").exists()


def test_an_unknown_event_log_handler_is_said_before_the_run(tmp_path) -> None:
    spec = WorkerSpec("r", 1, handler(), entrypoint="true", event_log_handler="kafka")
    with pytest.raises(KeyError, match="no event destination 'kafka'"):
        LocalElasticAgent(spec, log_dir=str(tmp_path))


# -- fn= runs ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_fn_warns_and_runs(marked, tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = WorkerSpec("trainer", 2, handler("fn-runs"), fn=fns.rank_squared, max_restarts=0)
    assert [w.category for w in caught] == [DeprecationWarning]
    result = LocalElasticAgent(spec, log_dir=str(tmp_path)).run()
    assert result.return_values == {0: 0, 1: 1}


# -- a user's rendezvous backend ----------------------------------------------------------------


class MyStaticHandler(StaticRendezvousHandler):
    """relaunch's static handler under the user's backend name."""

    def get_backend(self) -> str:
        return MY_BACKEND


def create_my_handler(params: RendezvousParameters) -> MyStaticHandler:
    return MyStaticHandler(params.run_id, 0, params.max_nodes, "127.0.0.1", 0)


@pytest.mark.timeout(60)
def test_a_backend_the_user_registered_runs_through_elastic_launch(marked) -> None:
    rendezvous_handler_registry.register(MY_BACKEND, create_my_handler)
    config = LaunchConfig(1, 1, 2, run_id="mine", rdzv_backend=MY_BACKEND, max_restarts=0)
    assert elastic_launch(config, fns.rank_squared)() == {0: 0, 1: 1}


@pytest.mark.timeout(60)
def test_an_unknown_backend_is_one_line_naming_the_registered_ones() -> None:
    config = LaunchConfig(1, 1, 1, rdzv_backend="c10 d", max_restarts=0)
    with pytest.raises(ValueError, match=r"unknown rendezvous backend 'c10 d': valid .*c10d") as e:
        elastic_launch(config, fns.rank_squared)()
    assert "\n" not in str(e.value)
