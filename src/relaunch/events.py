"""Status events and metrics the agent records, in torchelastic's shapes.

Events and metrics go to handlers the caller passes in (there is no global registry), so a launcher
can log to the console, to a JSON-lines file shared by all nodes' agents, or nowhere. The event
line is byte-for-byte what torchelastic's ``Event.serialize`` gives, so existing log tooling keeps
working.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

__all__ = [
    "ConsoleEventHandler",
    "ConsoleMetricHandler",
    "Event",
    "EventHandler",
    "EventMetadataValue",
    "EventSource",
    "JsonLinesEventHandler",
    "JsonLinesMetricHandler",
    "MetricData",
    "MetricHandler",
    "Metrics",
    "NullEventHandler",
    "NullMetricHandler",
    "event_handler_from_spec",
    "metric_handler_from_spec",
    "status_event",
]

EventMetadataValue = str | int | float | bool | None

_SPEC_FORMS = "'null', 'console', 'file:PATH' or 'jsonl:PATH'"


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


#: The size past which a JSON-lines file is rotated: renamed to ``PATH.1`` (replacing the one
#: before), and a new ``PATH`` begun. A file and its predecessor hold at most twice this.
MAX_LOG_BYTES = 64 * 1024 * 1024


class _JsonLinesWriter:
    """Appends whole lines to a file, each with one ``write(2)`` on an O_APPEND descriptor.

    One write per line means lines from concurrent processes appending to the same file never
    interleave, and a reader following the file (``tail -F``) sees each line as soon as it is
    recorded. The file is opened on the first line (so an unused handler creates nothing) and
    again after ``close`` if more lines come. Past ``max_bytes`` it is rotated to ``PATH.1``;
    of several writers sharing it, the one that finds the file still its own renames it, and
    the others follow to the new one.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_LOG_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _open(self) -> int:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        return os.open(self.path, flags, 0o644)

    def _rotate(self, fd: int) -> None:
        """Rename the file to ``PATH.1`` if it is still the one ``fd`` writes, and let go of
        ``fd``."""
        mine = os.fstat(fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        if named is not None and (named.st_ino, named.st_dev) == (mine.st_ino, mine.st_dev):
            os.replace(self.path, self.path + ".1")
        os.close(fd)

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                self._fd = self._open()
            size = os.fstat(self._fd).st_size
            if size and size + len(data) > self.max_bytes:
                self._rotate(self._fd)
                self._fd = self._open()
            view = memoryview(data)
            while view:  # a short write only happens on a full disk or a signal
                written = os.write(self._fd, view)
                view = view[written:]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)


# --- events -------------------------------------------------------------------------------------


class EventHandler(Protocol):
    """Where events go."""

    def record(self, event: Event) -> None: ...

    def close(self) -> None: ...


class NullEventHandler:
    """Drops every event; the default when no event log is asked for."""

    def record(self, event: Event) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleEventHandler:
    """Writes each event's JSON line to a stream (stderr, looked up at write time, by default)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def record(self, event: Event) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(event.serialize() + "\n")
        stream.flush()

    def close(self) -> None:
        pass


class JsonLinesEventHandler:
    """Appends each event as one JSON line to ``path`` as it happens (``docs/events.md``); safe
    across threads and processes; rotated to ``PATH.1`` past ``max_bytes``."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_LOG_BYTES) -> None:
        self._writer = _JsonLinesWriter(path, max_bytes)

    @property
    def path(self) -> str:
        return self._writer.path

    def record(self, event: Event) -> None:
        self._writer.write_line(event.serialize())

    def close(self) -> None:
        self._writer.close()


def _parse_spec(spec: str, what: str) -> tuple[str, str]:
    """``(kind, path)`` for a handler spec; ValueError naming the accepted forms otherwise."""
    text = spec.strip()
    if text in ("null", "console"):
        return text, ""
    kind, sep, path = text.partition(":")
    if sep and kind in ("file", "jsonl") and path:
        return "jsonl", path
    raise ValueError(f"bad {what} handler spec {spec!r}: expected {_SPEC_FORMS}")


def event_handler_from_spec(spec: str) -> EventHandler:
    """The event handler a ``--event-log-handler`` value names."""
    kind, path = _parse_spec(spec, "event")
    if kind == "null":
        return NullEventHandler()
    if kind == "console":
        return ConsoleEventHandler()
    return JsonLinesEventHandler(path)


# --- metrics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricData:
    """One metric sample, as torchelastic's ``MetricData``."""

    timestamp: float
    group_name: str
    name: str
    value: int


class MetricHandler(Protocol):
    """Where metrics go."""

    def emit(self, metric_data: MetricData) -> None: ...

    def close(self) -> None: ...


class NullMetricHandler:
    """Drops every metric; the default."""

    def emit(self, metric_data: MetricData) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleMetricHandler:
    """Writes ``[group].name=value``, one line per metric, to a stream (stderr by default)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def emit(self, metric_data: MetricData) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(f"[{metric_data.group_name}].{metric_data.name}={metric_data.value}\n")
        stream.flush()

    def close(self) -> None:
        pass


class JsonLinesMetricHandler:
    """Appends each metric as one JSON line (timestamp, group_name, name, value) to ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._writer = _JsonLinesWriter(path)

    @property
    def path(self) -> str:
        return self._writer.path

    def emit(self, metric_data: MetricData) -> None:
        self._writer.write_line(json.dumps(dataclasses.asdict(metric_data)))

    def close(self) -> None:
        self._writer.close()


def metric_handler_from_spec(spec: str) -> MetricHandler:
    """The metric handler a spec names (same forms as ``event_handler_from_spec``)."""
    kind, path = _parse_spec(spec, "metric")
    if kind == "null":
        return NullMetricHandler()
    if kind == "console":
        return ConsoleMetricHandler()
    return JsonLinesMetricHandler(path)


class Metrics:
    """Puts metrics to one handler under a default group; the caller owns the handler."""

    def __init__(self, handler: MetricHandler, group: str = "torchelastic") -> None:
        self.handler = handler
        self.group = group

    def put_metric(self, name: str, value: int, group: str | None = None) -> None:
        """Emit ``value`` for ``name``, stamped with the current time."""
        self.handler.emit(
            MetricData(
                timestamp=time.time(),
                group_name=self.group if group is None else group,
                name=name,
                value=value,
            )
        )
