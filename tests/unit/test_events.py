from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

from relaunch.core.run.group import GroupStatus
from relaunch.events import (
    ConsoleEventHandler,
    ConsoleMetricHandler,
    Event,
    EventSource,
    JsonLinesEventHandler,
    JsonLinesMetricHandler,
    MetricData,
    Metrics,
    NullEventHandler,
    NullMetricHandler,
    event_handler_from_spec,
    metric_handler_from_spec,
    status_event,
)

WORKER_LINE = (
    '{"name": "torchelastic.worker.status.SUCCEEDED", "source": "WORKER", "timestamp": 0, '
    '"metadata": {"run_id": "r1", "global_rank": 0, "group_rank": 0, "worker_id": "12172", '
    '"role": "trainer", "hostname": "host", "state": "SUCCEEDED", "total_run_time": 31, '
    '"rdzv_backend": "c10d", "raw_error": null, '
    '"metadata": "{\\"group_world_size\\": 1, \\"entry_point\\": \\"worker_fn\\", '
    '\\"local_rank\\": [0], \\"role_rank\\": [0], \\"role_world_size\\": [2]}", '
    '"agent_restarts": 0}}'
)

AGENT_LINE = (
    '{"name": "torchelastic.worker.status.FAILED", "source": "AGENT", "timestamp": 0, '
    '"metadata": {"run_id": "r1", "global_rank": null, "group_rank": 1, "worker_id": null, '
    '"role": "trainer", "hostname": "host", "state": "FAILED", "total_run_time": 7, '
    '"rdzv_backend": "static", "raw_error": "{\\"message\\": \\"boom\\"}", '
    '"metadata": "{\\"group_world_size\\": 2, \\"entry_point\\": \\"python\\"}", '
    '"agent_restarts": 3}}'
)


def worker_event(state: str = "SUCCEEDED") -> Event:
    return status_event(
        source=EventSource.WORKER,
        state=state,
        run_id="r1",
        role="trainer",
        hostname="host",
        rdzv_backend="c10d",
        group_rank=0,
        agent_restarts=0,
        total_run_time=31,
        global_rank=0,
        worker_id="12172",
        group_world_size=1,
        entry_point="worker_fn",
        local_rank=0,
        role_rank=0,
        role_world_size=2,
    )


def agent_event() -> Event:
    return status_event(
        source=EventSource.AGENT,
        state="FAILED",
        run_id="r1",
        role="trainer",
        hostname="host",
        rdzv_backend="static",
        group_rank=1,
        agent_restarts=3,
        total_run_time=7,
        raw_error=json.dumps({"message": "boom"}),
        group_world_size=2,
        entry_point="python",
    )


def test_worker_event_serializes_exactly_as_torchelastic() -> None:
    event = worker_event()
    assert event.name == "torchelastic.worker.status.SUCCEEDED"
    assert event.serialize() == WORKER_LINE


def test_agent_event_has_no_rank_worker_or_list_keys() -> None:
    line = agent_event().serialize()
    assert line == AGENT_LINE
    inner = json.loads(json.loads(line)["metadata"]["metadata"])
    assert list(inner) == ["group_world_size", "entry_point"]


def test_key_order_is_torchelastics() -> None:
    data = json.loads(worker_event().serialize())
    assert list(data) == ["name", "source", "timestamp", "metadata"]
    assert list(data["metadata"]) == [
        "run_id",
        "global_rank",
        "group_rank",
        "worker_id",
        "role",
        "hostname",
        "state",
        "total_run_time",
        "rdzv_backend",
        "raw_error",
        "metadata",
        "agent_restarts",
    ]


def test_state_may_be_a_str_enum() -> None:
    event = worker_event(state=GroupStatus.FAILED)
    assert event.name == "torchelastic.worker.status.FAILED"
    assert event.metadata["state"] == "FAILED"


@pytest.mark.parametrize("make", [worker_event, agent_event])
def test_deserialize_round_trips(make: object) -> None:
    assert callable(make)
    event = make()
    back = Event.deserialize(event.serialize())
    assert back == event
    assert back.source is event.source
    assert back.serialize() == event.serialize()
    assert Event.deserialize(event) is event


def test_source_given_as_a_string_serializes_by_name() -> None:
    event = Event(name="x", source="AGENT", timestamp=5, metadata={"k": 1.5})  # type: ignore[arg-type]
    assert event.source is EventSource.AGENT
    assert event.serialize() == (
        '{"name": "x", "source": "AGENT", "timestamp": 5, "metadata": {"k": 1.5}}'
    )


def test_deserialize_rejects_non_objects() -> None:
    with pytest.raises(ValueError):
        Event.deserialize("[1, 2]")


def test_console_handler_writes_one_line_per_event() -> None:
    out = io.StringIO()
    handler = ConsoleEventHandler(out)
    handler.record(worker_event())
    handler.record(agent_event())
    handler.close()
    assert out.getvalue() == WORKER_LINE + "\n" + AGENT_LINE + "\n"


def test_console_handler_looks_up_stderr_at_write_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handler = ConsoleEventHandler()
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    handler.record(agent_event())
    assert out.getvalue() == AGENT_LINE + "\n"


def test_null_handlers_do_nothing() -> None:
    NullEventHandler().record(worker_event())
    NullEventHandler().close()
    NullMetricHandler().emit(MetricData(0.0, "g", "n", 1))
    NullMetricHandler().close()


def test_jsonl_handler_appends_valid_lines(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "events.jsonl"
    handler = JsonLinesEventHandler(path)
    assert not path.exists()  # opened lazily
    events = [worker_event(), agent_event(), worker_event("FAILED")]
    for event in events:
        handler.record(event)
    lines = path.read_text().splitlines()  # flushed without close
    handler.close()
    assert len(lines) == 3
    assert [Event.deserialize(line) for line in lines] == events
    for line in lines:
        json.loads(line)


def test_jsonl_handler_appends_to_an_existing_file_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("earlier\n")
    handler = JsonLinesEventHandler(str(path))
    handler.record(agent_event())
    handler.close()
    handler.close()
    handler.record(agent_event())
    handler.close()
    assert path.read_text().splitlines() == ["earlier", AGENT_LINE, AGENT_LINE]


def test_jsonl_handler_rotates_past_its_bound_and_a_second_writer_follows(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    bound = 3 * (len(AGENT_LINE) + 1)  # three lines a file
    first, second = JsonLinesEventHandler(path, bound), JsonLinesEventHandler(path, bound)
    for _ in range(3):
        first.record(agent_event())
    second.record(agent_event())  # its file is full too: it rotates, first finds it renamed
    first.record(agent_event())
    assert (tmp_path / "events.jsonl.1").read_text().splitlines() == [AGENT_LINE] * 3
    assert path.read_text().splitlines() == [AGENT_LINE] * 2
    for _ in range(2):
        first.record(agent_event())
    # Rotated once more: the older file is replaced; never more than two files of the bound.
    assert (tmp_path / "events.jsonl.1").read_text().splitlines() == [AGENT_LINE] * 3
    assert path.read_text().splitlines() == [AGENT_LINE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.jsonl.1"]
    first.close()
    second.close()


def test_jsonl_handler_is_thread_safe(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    handler = JsonLinesEventHandler(path)

    def work() -> None:
        for _ in range(50):
            handler.record(worker_event())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handler.close()
    lines = path.read_text().splitlines()
    assert lines == [WORKER_LINE] * 200


def test_event_handler_from_spec(tmp_path: Path) -> None:
    assert isinstance(event_handler_from_spec("null"), NullEventHandler)
    assert isinstance(event_handler_from_spec("console"), ConsoleEventHandler)
    for kind in ("file", "jsonl"):
        target = tmp_path / f"{kind}.jsonl"
        handler = event_handler_from_spec(f"{kind}:{target}")
        assert isinstance(handler, JsonLinesEventHandler)
        assert handler.path == str(target)
        handler.record(agent_event())
        handler.close()
        assert target.read_text() == AGENT_LINE + "\n"


@pytest.mark.parametrize("spec", ["", "nope", "file:", "jsonl", "stdout:x", "Console"])
def test_bad_spec_raises_one_line_value_error(spec: str) -> None:
    for from_spec in (event_handler_from_spec, metric_handler_from_spec):
        with pytest.raises(ValueError) as info:
            from_spec(spec)
        message = str(info.value)
        assert "\n" not in message
        for form in ("null", "console", "file:PATH", "jsonl:PATH"):
            assert form in message


def test_metrics_to_console() -> None:
    out = io.StringIO()
    metrics = Metrics(ConsoleMetricHandler(out), "agent")
    metrics.put_metric("workers.trainer.run_success", 1)
    metrics.put_metric("restarts", 2, group="other")
    assert out.getvalue() == "[agent].workers.trainer.run_success=1\n[other].restarts=2\n"


def test_metrics_to_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "m" / "metrics.jsonl"
    handler = metric_handler_from_spec(f"jsonl:{path}")
    assert isinstance(handler, JsonLinesMetricHandler)
    metrics = Metrics(handler)
    metrics.put_metric("a", 1)
    metrics.put_metric("b", 2, group="g")
    handler.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [list(row) for row in rows] == [["timestamp", "group_name", "name", "value"]] * 2
    assert [(r["group_name"], r["name"], r["value"]) for r in rows] == [
        ("torchelastic", "a", 1),
        ("g", "b", 2),
    ]
    assert all(isinstance(r["timestamp"], float) and r["timestamp"] > 0 for r in rows)


def test_metric_handler_from_spec() -> None:
    assert isinstance(metric_handler_from_spec("null"), NullMetricHandler)
    assert isinstance(metric_handler_from_spec("console"), ConsoleMetricHandler)
    assert isinstance(metric_handler_from_spec("file:/tmp/x.jsonl"), JsonLinesMetricHandler)
