"""Where the agent's status events and metrics go: handlers the caller passes in (there is no
global registry), so a launcher can log to the console, to a JSON-lines file shared by all
nodes' agents, or nowhere.

The events and metric samples themselves, in torchelastic's shapes, are built without I/O in
``relaunch.core.status_events`` (re-exported here); the files are appended to by
``relaunch.jsonl_file``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import IO, Protocol

from relaunch.core.status_events import (
    Event,
    EventMetadataValue,
    EventSource,
    MetricData,
    parse_spec,
    spec_path,
    status_event,
)
from relaunch.jsonl_file import MAX_LOG_BYTES, JsonLinesWriter, check_log_file
from relaunch.jsonl_file import creatable as creatable  # config's log-directory check
from relaunch.runtime import SYSTEM_CLOCK, Clock

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
    "check_log_file",
    "event_handler_from_spec",
    "metric_handler_from_spec",
    "spec_path",
    "status_event",
]


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
    """Writes each event's JSON line to a stream (stderr, looked up at write time, by default).

    A write error (a closed pipe, a full disk, ``/dev/full``) never reaches the agent: the first
    is said once on the same stream if it takes it, and events that cannot be written are
    dropped; the job goes on.
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream
        self._failed = False

    def record(self, event: Event) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            stream.write(event.serialize() + "\n")
            stream.flush()
        except (OSError, ValueError) as exc:  # ValueError: the stream was closed
            if self._failed:
                return
            self._failed = True
            try:
                stream.write(
                    f"relaunch: cannot write events to the console ({exc}): dropping them; "
                    "the job goes on\n"
                )
                stream.flush()
            except (OSError, ValueError):
                pass  # nowhere to say it

    def close(self) -> None:
        pass


class JsonLinesEventHandler:
    """Appends each event as one JSON line to ``path`` as it happens (``docs/events.md``); safe
    across threads and processes; rotated to ``PATH.1`` past ``max_bytes``."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_LOG_BYTES) -> None:
        self._writer = JsonLinesWriter(path, max_bytes)

    @property
    def path(self) -> str:
        return self._writer.path

    def record(self, event: Event) -> None:
        self._writer.write_line(event.serialize())

    def close(self) -> None:
        self._writer.close()


def event_handler_from_spec(spec: str) -> EventHandler:
    """The event handler a ``--event-log-handler`` value names."""
    kind, path = parse_spec(spec, "event")
    if kind == "null":
        return NullEventHandler()
    if kind == "console":
        return ConsoleEventHandler()
    return JsonLinesEventHandler(path)


# --- metrics ------------------------------------------------------------------------------------


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
        self._writer = JsonLinesWriter(path)

    @property
    def path(self) -> str:
        return self._writer.path

    def emit(self, metric_data: MetricData) -> None:
        self._writer.write_line(json.dumps(dataclasses.asdict(metric_data)))

    def close(self) -> None:
        self._writer.close()


def metric_handler_from_spec(spec: str) -> MetricHandler:
    """The metric handler a spec names (same forms as ``event_handler_from_spec``)."""
    kind, path = parse_spec(spec, "metric")
    if kind == "null":
        return NullMetricHandler()
    if kind == "console":
        return ConsoleMetricHandler()
    return JsonLinesMetricHandler(path)


class Metrics:
    """Puts metrics to one handler under a default group, stamped with ``clock``'s wall time;
    the caller owns the handler."""

    def __init__(
        self, handler: MetricHandler, group: str = "torchelastic", clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.handler = handler
        self.group = group
        self._clock = clock

    def put_metric(self, name: str, value: int, group: str | None = None) -> None:
        """Emit ``value`` for ``name``, stamped with the current time."""
        self.handler.emit(
            MetricData(
                timestamp=self._clock.time(),
                group_name=self.group if group is None else group,
                name=name,
                value=value,
            )
        )
