"""relaunch.events beside torch.distributed.elastic.events: the same event gives the same JSON,
and torch's module functions (record, get_logging_handler, construct_and_record_rdzv_event)
exist and behave as torch's."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from relaunch import events
from relaunch.events import handlers as relaunch_handlers

pytestmark = pytest.mark.xdist_group("torch")

torch_events = pytest.importorskip("torch.distributed.elastic.events")
torch_handlers = pytest.importorskip("torch.distributed.elastic.events.handlers")

METADATA: dict[str, str | int | float | bool | None] = {
    "run_id": "job-7",
    "global_rank": 3,
    "ratio": 0.5,
    "ok": True,
    "raw_error": None,
    "text": 'quote " and ünïcode',
}


def test_the_same_event_serializes_to_the_same_json() -> None:
    for source in ("AGENT", "WORKER"):
        mine = events.Event(
            "torchelastic.worker.status.FAILED", events.EventSource[source], 1700, METADATA
        )
        theirs = torch_events.Event(
            "torchelastic.worker.status.FAILED", torch_events.EventSource[source], 1700, METADATA
        )
        assert mine.serialize() == theirs.serialize()
        assert str(mine) == str(theirs) == mine.serialize()


def test_each_side_reads_the_others_json() -> None:
    theirs = torch_events.Event("e", torch_events.EventSource.WORKER, 5, METADATA)
    mine = events.Event.deserialize(theirs.serialize())
    assert (mine.name, mine.source, mine.timestamp, mine.metadata) == (
        "e",
        events.EventSource.WORKER,
        5,
        METADATA,
    )
    back = torch_events.Event.deserialize(mine.serialize())
    assert back == theirs


def test_rendezvous_events_and_node_states_match() -> None:
    assert [s.value for s in events.NodeState] == [s.value for s in torch_events.NodeState]
    fields = {
        "name": "dynamic_rendezvous.py:next_rendezvous",
        "run_id": "job",
        "message": "joined",
        "hostname": "node-1",
        "pid": 42,
        "master_endpoint": "h:29400",
        "rank": 1,
        "local_id": 0,
        "error_trace": "",
    }
    for state in ("INIT", "RUNNING", "SUCCEEDED", "FAILED"):
        mine = events.RdzvEvent(node_state=events.NodeState[state], **fields)
        theirs = torch_events.RdzvEvent(node_state=torch_events.NodeState[state], **fields)
        assert mine.serialize() == theirs.serialize()
        assert str(mine) == str(theirs)
        assert events.RdzvEvent.deserialize(theirs.serialize()) == mine
        assert torch_events.RdzvEvent.deserialize(mine.serialize()) == theirs


def test_record_to_the_console_writes_the_line_torch_writes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    event_args = ("test_event", "WORKER", 9, {"k": 1})
    console = torch_handlers.get_logging_handler("console")
    buffer = io.StringIO()
    old = console.setStream(buffer)
    try:
        torch_events.record(
            torch_events.Event(event_args[0], torch_events.EventSource.WORKER, *event_args[2:]),
            destination="console",
        )
    finally:
        console.setStream(old)
    capsys.readouterr()
    events.record(
        events.Event(event_args[0], events.EventSource.WORKER, *event_args[2:]), "console"
    )
    assert capsys.readouterr().err == buffer.getvalue() != ""


def test_record_drops_events_for_null_and_writes_files(tmp_path, capsys) -> None:
    event = events.Event("e", events.EventSource.AGENT, 1)
    events.record(event)  # the default destination, "null"
    events.record(event, destination="null")
    assert capsys.readouterr() == ("", "")
    path = tmp_path / "events.jsonl"
    events.record(event, destination=f"file:{path}")
    events.record(event, destination=f"file:{path}")
    assert path.read_text().splitlines() == [event.serialize()] * 2


def test_logging_handlers_are_torchs_kinds() -> None:
    for destination in ("console", "null", "dynamic_rendezvous"):
        mine = events.get_logging_handler(destination)
        theirs = torch_handlers.get_logging_handler(destination)
        assert isinstance(mine, logging.Handler)
        assert isinstance(mine, logging.NullHandler) == isinstance(theirs, logging.NullHandler)
    assert events.get_logging_handler() is events.get_logging_handler("null")


def test_an_unknown_destination_is_a_key_error_as_in_torch() -> None:
    with pytest.raises(KeyError):
        torch_handlers.get_logging_handler("nowhere")
    with pytest.raises(KeyError) as raised:
        events.get_logging_handler("nowhere")
    assert str(raised.value).startswith("no event destination 'nowhere': expected 'console'")
    with pytest.raises(KeyError):
        events.record(events.Event("e", events.EventSource.AGENT), destination="nowhere")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def rdzv_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Lines, _Lines]]:
    """A handler keeping the lines of each side's "dynamic_rendezvous" destination (dropped by
    default), put where each side looks for it."""
    mine, theirs = _Lines(), _Lines()
    monkeypatch.setitem(relaunch_handlers._log_handlers, "dynamic_rendezvous", mine)
    monkeypatch.setattr(events, "_events_loggers", {})
    monkeypatch.setitem(torch_handlers._log_handlers, "dynamic_rendezvous", theirs)
    monkeypatch.setattr(torch_events, "_events_loggers", {})
    yield mine, theirs
    for name in ("relaunch-events-dynamic_rendezvous", "torchelastic-events-dynamic_rendezvous"):
        logger = logging.getLogger(name)
        for handler in (mine, theirs):
            logger.removeHandler(handler)


def test_construct_and_record_rdzv_event_records_what_torch_records(rdzv_lines) -> None:
    mine, theirs = rdzv_lines
    common = {"run_id": "job", "message": "m", "hostname": "h", "pid": 7, "rank": 2}
    events.construct_and_record_rdzv_event(node_state=events.NodeState.RUNNING, **common)
    torch_events.construct_and_record_rdzv_event(
        node_state=torch_events.NodeState.RUNNING, **common
    )
    try:
        raise RuntimeError("the store is gone")
    except RuntimeError:
        events.construct_and_record_rdzv_event(
            node_state=events.NodeState.FAILED, name="join", local_id=0, **common
        )
        torch_events.construct_and_record_rdzv_event(
            node_state=torch_events.NodeState.FAILED, name="join", local_id=0, **common
        )
    assert len(mine.lines) == len(theirs.lines) == 2
    assert [json.loads(line) for line in mine.lines] == [json.loads(line) for line in theirs.lines]
    first, failed = (json.loads(line) for line in mine.lines)
    assert first["name"] == (
        "test_compat_events.py:test_construct_and_record_rdzv_event_records_what_torch_records"
    )
    assert failed["name"] == "test_compat_events.py:join"
    assert "RuntimeError: the store is gone" in failed["error_trace"]


def test_construct_and_record_rdzv_event_fills_host_and_pid(rdzv_lines) -> None:
    import os
    import socket

    mine, _ = rdzv_lines
    events.construct_and_record_rdzv_event("job", "m", events.NodeState.INIT)
    (line,) = mine.lines
    assert (json.loads(line)["hostname"], json.loads(line)["pid"]) == (
        socket.getfqdn(),
        os.getpid(),
    )


def test_rdzv_events_are_not_built_while_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lookup() -> str:
        raise AssertionError("the host name was looked up for an event nobody keeps")

    import socket

    monkeypatch.setattr(socket, "getfqdn", no_lookup)
    events.construct_and_record_rdzv_event("job", "m", events.NodeState.INIT)
