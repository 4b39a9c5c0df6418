"""Where the agent's status events and metrics go: handlers the caller passes in (there is no
global registry), so a launcher can log to the console, to a JSON-lines file shared by all
nodes' agents, or nowhere.

The events and metric samples themselves, in torchelastic's shapes, are built without I/O in
``relaunch.core.output.status_events`` (re-exported here); the files are appended to by
``relaunch.jsonl_file``. Both load on first use: a run whose events and metrics go nowhere (the
null handlers, the default) builds none and loads neither.

torch's module functions are here too, with torch's meaning: ``record(event, destination)``
sends an event to the ``logging`` handler a destination names (``handlers``), and
``construct_and_record_rdzv_event`` builds and records a rendezvous event (dropped unless the
``"dynamic_rendezvous"`` destination has a handler that keeps it).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, TYPE_CHECKING, Protocol

from relaunch.core.defaults import MAX_LOG_BYTES as MAX_LOG_BYTES  # the files' rotation size
from relaunch.runtime import SYSTEM_CLOCK, Clock, lazy_attributes

if TYPE_CHECKING:
    # isort: off
    from relaunch.core.output.status_events import (
        Event as Event,
        EventMetadataValue as EventMetadataValue,
        EventSource as EventSource,
        MetricData as MetricData,
        NodeState as NodeState,
        RdzvEvent as RdzvEvent,
        spec_path as spec_path,
        status_event as status_event,
    )
    from relaunch.events.handlers import get_logging_handler as get_logging_handler
    from relaunch.jsonl_file import (
        check_log_file as check_log_file,
        creatable as creatable,  # config's directory checks
        unwritable as unwritable,
    )
    # isort: on

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
    "NodeState",
    "NullEventHandler",
    "NullMetricHandler",
    "RdzvEvent",
    "check_log_file",
    "construct_and_record_rdzv_event",
    "event_handler_from_spec",
    "get_logging_handler",
    "metric_handler_from_spec",
    "record",
    "record_rdzv_event",
    "spec_path",
    "status_event",
]


#: The names that load on first use, by the module that defines each: a launch whose events
#: and metrics go nowhere (the null handlers) builds none and loads none of them.
_LAZY = {
    **dict.fromkeys(
        (
            "Event",
            "EventMetadataValue",
            "EventSource",
            "MetricData",
            "NodeState",
            "RdzvEvent",
            "spec_path",
            "status_event",
        ),
        "relaunch.core.output.status_events",
    ),
    "get_logging_handler": "relaunch.events.handlers",
    "check_log_file": "relaunch.jsonl_file",
    "creatable": "relaunch.jsonl_file",
    "unwritable": "relaunch.jsonl_file",
}

__getattr__ = lazy_attributes(__name__, _LAZY)


# --- torch's module functions: events to ``logging`` handlers, by destination ------------------

_events_loggers: dict[str, logging.Logger] = {}


def _logger(destination: str) -> logging.Logger:
    """The logger that sends to ``destination``'s handler only (it does not propagate, so each
    event is handled once)."""
    events_logger = _events_loggers.get(destination)
    if events_logger is None:
        from relaunch.events.handlers import get_logging_handler

        handler = get_logging_handler(destination)
        events_logger = logging.getLogger(f"relaunch-events-{destination}")
        events_logger.setLevel(logging.INFO)
        events_logger.propagate = False
        if handler not in events_logger.handlers:
            events_logger.addHandler(handler)
        events_logger = _events_loggers.setdefault(destination, events_logger)
    return events_logger


def record(event: Event, destination: str = "null") -> None:
    """Send ``event``'s JSON line to ``destination`` (``"console"``, ``"null"``,
    ``"dynamic_rendezvous"`` or ``"file:PATH"``; KeyError for another)."""
    _logger(destination).info(event.serialize())


def record_rdzv_event(event: RdzvEvent) -> None:
    """Send a rendezvous event's JSON line to the ``"dynamic_rendezvous"`` destination."""
    _logger("dynamic_rendezvous").info(event.serialize())


def construct_and_record_rdzv_event(
    run_id: str,
    message: str,
    node_state: NodeState,
    name: str = "",
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
) -> None:
    """Build a rendezvous event and record it (``record_rdzv_event``), as torch does: named
    ``"<caller's file>:<name or caller's function>"``, with this host (``socket.getfqdn``) and
    pid unless given, and the exception being handled as ``error_trace`` when ``node_state``
    is ``FAILED``. Nothing is built while the destination drops events."""
    from relaunch.core.output.status_events import NodeState, RdzvEvent
    from relaunch.events.handlers import get_logging_handler

    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return
    if not hostname:
        import socket

        hostname = socket.getfqdn()
    if not pid:
        pid = os.getpid()
    caller = sys._getframe(1)
    if not name:
        name = caller.f_code.co_name
    filename = os.path.basename(caller.f_code.co_filename)
    del caller  # a frame kept alive holds every local of the caller
    error_trace = ""
    if node_state == NodeState.FAILED:
        import traceback

        error_trace = traceback.format_exc()
    record_rdzv_event(
        RdzvEvent(
            name=f"{filename}:{name}",
            run_id=run_id,
            message=message,
            hostname=hostname,
            pid=pid,
            node_state=node_state,
            master_endpoint=master_endpoint,
            rank=rank,
            local_id=local_id,
            error_trace=error_trace,
        )
    )


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
        from relaunch.jsonl_file import JsonLinesWriter

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
    if spec == "null":  # the default: nothing to parse or to load
        return NullEventHandler()
    from relaunch.core.output.status_events import parse_spec

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
        from relaunch.jsonl_file import JsonLinesWriter

        self._writer = JsonLinesWriter(path)

    @property
    def path(self) -> str:
        return self._writer.path

    def emit(self, metric_data: MetricData) -> None:
        import dataclasses
        import json

        self._writer.write_line(json.dumps(dataclasses.asdict(metric_data)))

    def close(self) -> None:
        self._writer.close()


def metric_handler_from_spec(spec: str) -> MetricHandler:
    """The metric handler a spec names (same forms as ``event_handler_from_spec``)."""
    if spec == "null":
        return NullMetricHandler()
    from relaunch.core.output.status_events import parse_spec

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
        """Emit ``value`` for ``name``, stamped with the current time (nothing is built for the
        null handler, which drops it)."""
        if type(self.handler) is NullMetricHandler:
            return
        from relaunch.core.output.status_events import MetricData

        self.handler.emit(
            MetricData(
                timestamp=self._clock.time(),
                group_name=self.group if group is None else group,
                name=name,
                value=value,
            )
        )
