"""The agent and the launcher API with real worker processes."""

from __future__ import annotations

import json
import os

import agentfns
import pytest
from conftest import LeakCheck

from relaunch.agent import LocalElasticAgent, RunResult, WorkerSpec, WorkerState
from relaunch.events import JsonLinesEventHandler
from relaunch.launcher import LaunchConfig, elastic_launch
from relaunch.procs.errors import ChildFailedError
from relaunch.rendezvous import StaticRendezvousHandler

pytestmark = pytest.mark.timeout(60)


def config(tmp_path, **overrides: object) -> LaunchConfig:
    settings: dict = {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 2,
        "run_id": "job42",
        "rdzv_endpoint": "127.0.0.1:0",
        "max_restarts": 0,
        "log_dir": str(tmp_path / "logs"),
        **overrides,
    }
    return LaunchConfig(**settings)


def test_elastic_launch_returns_values_by_global_rank_with_torchruns_env(
    tmp_path, leaks: LeakCheck, monkeypatch
) -> None:
    monkeypatch.setenv("RELAUNCH_TEST_MARK", leaks.mark)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    values = elastic_launch(config(tmp_path, role="trainer"), agentfns.environment)("x")
    assert sorted(values) == [0, 1]
    for rank, env in values.items():
        assert env["tag"] == "x"
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["ROLE_NAME"] == "trainer"
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "job42"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")
    assert values[0]["MASTER_PORT"] == values[1]["MASTER_PORT"]


def test_a_failure_restarts_the_group_while_restarts_remain(
    tmp_path, leaks: LeakCheck, monkeypatch
) -> None:
    monkeypatch.setenv("RELAUNCH_TEST_MARK", leaks.mark)
    values = elastic_launch(config(tmp_path, max_restarts=2), agentfns.fail_first_attempt)()
    assert values == {0: "rank 0 attempt 1", 1: "rank 1 attempt 1"}
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert run_dir.name.startswith("job42_")
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1"]
    error = json.loads((run_dir / "attempt_0" / "1" / "error.json").read_text())
    assert error["message"]["message"] == "RuntimeError: first attempt fails"


def test_without_restarts_left_the_failure_is_raised_by_global_rank(
    tmp_path, leaks: LeakCheck, monkeypatch
) -> None:
    monkeypatch.setenv("RELAUNCH_TEST_MARK", leaks.mark)
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config(tmp_path, max_restarts=1), agentfns.always_fail)()
    error = caught.value
    assert error.name == "always_fail"
    assert set(error.failures) | set(error.stopped) == {0, 1}
    rank, first = error.get_first_failure()
    assert f"KeyError: 'rank {rank}'" in first.details
    assert str(error).splitlines()[1] == "Root cause (first failure):"


def test_agent_run_records_worker_and_agent_events(tmp_path, leaks: LeakCheck, monkeypatch) -> None:
    monkeypatch.setenv("RELAUNCH_TEST_MARK", leaks.mark)
    events_file = tmp_path / "events.jsonl"
    handler = StaticRendezvousHandler("run9", 0, 1, "127.0.0.1", 0)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=handler,
        entrypoint=agentfns.environment,
        args=("e",),
        max_restarts=0,
    )
    sink = JsonLinesEventHandler(events_file)
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path / "logs"), event_handler=sink)
    result = agent.run()
    sink.close()
    assert isinstance(result, RunResult) and result.state is WorkerState.SUCCEEDED
    assert not result.is_failed() and sorted(result.return_values) == [0, 1]
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    # relaunch's HEALTHY when the group started (docs/events.md), then torchelastic's at the end.
    started, *events = events
    assert (started["source"], started["name"]) == ("AGENT", "torchelastic.worker.status.HEALTHY")
    assert [(e["source"], e["metadata"]["global_rank"]) for e in events] == [
        ("WORKER", 0),
        ("WORKER", 1),
        ("AGENT", None),
    ]
    for event in events:
        assert event["name"] == "torchelastic.worker.status.SUCCEEDED"
        assert event["metadata"]["run_id"] == "run9"
        assert event["metadata"]["rdzv_backend"] == "static"
    assert agent.get_worker_group().state is WorkerState.SUCCEEDED
    assert os.path.isdir(os.path.join(agent.log_dir, "attempt_0", "1"))


def test_worker_spec_and_config_refuse_nonsense(tmp_path) -> None:
    handler = StaticRendezvousHandler("r", 0, 1, "127.0.0.1", 0)
    with pytest.raises(ValueError, match="local_world_size"):
        WorkerSpec(role="r", local_world_size=0, rdzv_handler=handler, entrypoint="true")
    with pytest.raises(ValueError, match="max_restarts"):
        WorkerSpec(
            role="r", local_world_size=1, rdzv_handler=handler, entrypoint="true", max_restarts=-1
        )
    with pytest.raises(ValueError, match="min_nodes <= max_nodes"):
        config(tmp_path, min_nodes=3, max_nodes=1)
    with pytest.raises(ValueError, match=r"node-rank 2 is outside 0\.\.1"):
        StaticRendezvousHandler("r", 2, 2, "127.0.0.1", 29500)
