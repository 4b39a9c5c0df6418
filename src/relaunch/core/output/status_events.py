"""Status events and metric samples in torchelastic's shapes, and the handler specs that say
where they go; pure: values in, records and text out (``relaunch.events`` writes them).

The event line is byte-for-byte what torchelastic's ``Event.serialize`` gives, so existing log
tooling keeps working.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

EventMetadataValue = str | int | float | bool | None

#: The forms a handler spec takes (``--event-log-handler``, a metric handler).
SPEC_FORMS = "'null', 'console', 'file:PATH' or 'jsonl:PATH'"


class EventSource(str, enum.Enum):
    """Who an event is about: the agent itself or one of its workers."""

    AGENT = "AGENT"
    WORKER = "WORKER"


@dataclass
class Event:
    """One status event; ``serialize`` gives torchelastic's one-line JSON for it."""

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Accept "WORKER" as well as EventSource.WORKER, so a deserialized or hand-built event
        # always serializes its source by name.
        self.source = EventSource(self.source)

    def __str__(self) -> str:
        return self.serialize()

    def serialize(self) -> str:
        """One line of JSON: name, source (by name), timestamp, metadata, in that order."""
        return json.dumps(
            {
                "name": self.name,
                "source": self.source.name,
                "timestamp": self.timestamp,
                "metadata": self.metadata,
            }
        )

    @staticmethod
    def deserialize(data: str | Event) -> Event:
        """The inverse of ``serialize``; an ``Event`` is returned as it is."""
        if isinstance(data, Event):
            return data
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError(f"not a serialized event: {data!r}")
        return Event(
            name=str(raw["name"]),
            source=EventSource[raw["source"]],
            timestamp=int(raw.get("timestamp", 0)),
            metadata=dict(raw.get("metadata") or {}),
        )


class NodeState(str, enum.Enum):
    """Where a node stands in a rendezvous, as torchelastic's rendezvous events say it."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class RdzvEvent:
    """One rendezvous event; ``serialize`` gives torchelastic's one-line JSON for it (its
    fields in this order, ``node_state`` by name)."""

    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: int | None = None
    local_id: int | None = None
    error_trace: str = ""

    def __str__(self) -> str:
        return self.serialize()

    def serialize(self) -> str:
        """One line of JSON with every field."""
        return json.dumps(
            {
                "name": self.name,
                "run_id": self.run_id,
                "message": self.message,
                "hostname": self.hostname,
                "pid": self.pid,
                "node_state": NodeState(self.node_state).value,
                "master_endpoint": self.master_endpoint,
                "rank": self.rank,
                "local_id": self.local_id,
                "error_trace": self.error_trace,
            }
        )

    @staticmethod
    def deserialize(data: str | RdzvEvent) -> RdzvEvent:
        """The inverse of ``serialize``; an ``RdzvEvent`` is returned as it is."""
        if isinstance(data, RdzvEvent):
            return data
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError(f"not a serialized rendezvous event: {data!r}")
        raw["node_state"] = NodeState[raw["node_state"]]
        return RdzvEvent(**raw)


def _plain(value: Any) -> Any:
    """An enum's value, anything else as it is (a str-mixin enum formats oddly before 3.12)."""
    return value.value if isinstance(value, enum.Enum) else value


def status_event(
    *,
    source: EventSource,
    state: str,
    run_id: str,
    role: str,
    hostname: str,
    rdzv_backend: str,
    group_rank: int | None,
    agent_restarts: int,
    total_run_time: int,
    global_rank: int | None = None,
    worker_id: str | None = None,
    raw_error: str | None = None,
    group_world_size: int | None = None,
    entry_point: str | None = None,
    local_rank: int | None = None,
    role_rank: int | None = None,
    role_world_size: int | None = None,
    progress: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
) -> Event:
    """A ``torchelastic.worker.status.<STATE>`` event with torchelastic's metadata keys and order.

    Worker events pass ``local_rank``/``role_rank``/``role_world_size``; they go into the inner
    JSON-string metadata as one-element lists, as torchelastic writes them. Agent events leave
    them out.
    """
    state_name = str(_plain(state))
    inner: dict[str, Any] = {"group_world_size": group_world_size, "entry_point": entry_point}
    if local_rank is not None:
        inner["local_rank"] = [local_rank]
    if role_rank is not None:
        inner["role_rank"] = [role_rank]
    if role_world_size is not None:
        inner["role_world_size"] = [role_world_size]
    if progress is not None:  # relaunch's addition: the worker's last report_progress
        inner["progress"] = progress
    if details:  # relaunch's additions (docs/events.md): a restart's cause, a straggler's rate
        inner.update(details)
    metadata: dict[str, EventMetadataValue] = {
        "run_id": run_id,
        "global_rank": global_rank,
        "group_rank": group_rank,
        "worker_id": worker_id,
        "role": role,
        "hostname": hostname,
        "state": state_name,
        "total_run_time": total_run_time,
        "rdzv_backend": rdzv_backend,
        "raw_error": raw_error,
        "metadata": json.dumps(inner),
        "agent_restarts": agent_restarts,
    }
    return Event(
        name=f"torchelastic.worker.status.{state_name}",
        source=EventSource(source),
        metadata=metadata,
    )


@dataclass(frozen=True)
class MetricData:
    """One metric sample, as torchelastic's ``MetricData``."""

    timestamp: float
    group_name: str
    name: str
    value: int


def parse_spec(spec: str, what: str) -> tuple[str, str]:
    """``(kind, path)`` for a handler spec; ValueError naming the accepted forms otherwise."""
    text = spec.strip()
    if text in ("null", "console"):
        return text, ""
    kind, sep, path = text.partition(":")
    if sep and kind in ("file", "jsonl") and path:
        return "jsonl", path
    raise ValueError(f"bad {what} handler spec {spec!r}: expected {SPEC_FORMS}")


def spec_path(spec: str) -> str:
    """The file a handler spec names (``file:PATH``, ``jsonl:PATH``); "" for the others."""
    kind, path = parse_spec(spec, "event")
    return path if kind == "jsonl" else ""
