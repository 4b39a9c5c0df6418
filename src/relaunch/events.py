"""Status events and metrics the agent records, in torchelastic's shapes.

Events and metrics go to handlers the caller passes in (there is no global registry), so a launcher
can log to the console, to a JSON-lines file shared by all nodes' agents, or nowhere. The event
line is byte-for-byte what torchelastic's ``Event.serialize`` gives, so existing log tooling keeps
working.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import logging
import os
import stat
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
    "check_log_file",
    "event_handler_from_spec",
    "metric_handler_from_spec",
    "spec_path",
    "status_event",
]

EventMetadataValue = str | int | float | bool | None

log = logging.getLogger(__name__)

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

    The file is opened with ``O_NOFOLLOW``: a symbolic link planted at ``PATH`` (say, to a file
    of the user's in a shared directory) is refused, never appended to. A line that cannot be
    written (a full disk, an I/O error, the file gone) never raises: the first failure is said
    once, naming the file and the cause, later lines are tried again, and the recovery is said
    with the number of lines lost.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_LOG_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._lost = 0  # lines not written since the last failure was said
        self._torn = False  # a line was cut short by a failure: the next one starts afresh

    def _open(self) -> int:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        flags = (
            os.O_WRONLY
            | os.O_APPEND
            | os.O_CREAT
            | os.O_NOFOLLOW
            | os.O_NONBLOCK  # a FIFO planted at PATH must not block the open
            | getattr(os, "O_CLOEXEC", 0)
        )
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(exc.errno, _SYMLINK_REFUSED) from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
                raise OSError(errno.EINVAL, "not a regular file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _rotate(self, fd: int) -> None:
        """Rename the file to ``PATH.1`` if it is still the one ``fd`` writes, and let go of
        ``fd``. (``rename`` moves a name, never what a link at ``PATH.1`` points to.)"""
        try:
            mine = os.fstat(fd)
            try:
                named = os.lstat(self.path)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_ino, named.st_dev) == (mine.st_ino, mine.st_dev):
                os.replace(self.path, self.path + ".1")
        finally:
            os.close(fd)

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        with self._lock:
            try:
                self._write(data)
            except OSError as exc:
                self._failed(exc)
            else:
                if self._lost:
                    log.warning(
                        "%s: writing again (%d line%s lost)",
                        self.path,
                        self._lost,
                        "" if self._lost == 1 else "s",
                    )
                    self._lost = 0

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            self._fd = self._open()
        size = os.fstat(self._fd).st_size
        if size and size + len(data) > self.max_bytes:
            fd, self._fd = self._fd, None
            self._rotate(fd)
            self._fd = self._open()
        if self._torn:
            data = b"\n" + data  # the cut line stays a line of its own, never glued to this
        view = memoryview(data)
        while view:  # a short write only happens on a full disk or a signal
            try:
                written = os.write(self._fd, view)
            except OSError:
                self._torn = self._torn or len(view) < len(data)
                raise
            view = view[written:]
            self._torn = bool(view)
        self._torn = False

    def _failed(self, exc: OSError) -> None:
        if not self._lost:
            log.warning(
                "cannot write %s (%s): its lines are dropped until it can be written again; "
                "the job goes on",
                self.path,
                exc.strerror or exc,
            )
        self._lost += 1
        if self._fd is not None and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            # An I/O error, or the file replaced under us: reopen it for the next line.
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.close(fd)
                except OSError:  # a deferred write error (NFS): said as any other
                    pass


_SYMLINK_REFUSED = (
    "it is a symbolic link, which relaunch does not follow (it would append to whatever the "
    "link points at): remove it or name the file itself"
)


def check_log_file(path: str, what: str = "event log") -> None:
    """Whether ``path`` can be the file of a JSON-lines handler: ValueError in one line saying
    what is wrong and what to do when it cannot (a directory, a symbolic link, something other
    than a file, a file that cannot be written, a place where none can be created). Creates
    nothing."""
    try:
        info: os.stat_result | None = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        info = None  # creatable() says why not, if it cannot be created
    except OSError as exc:
        raise ValueError(f"{what} {path}: {_why(exc, path)}") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise ValueError(f"{what} {path}: {_SYMLINK_REFUSED}")
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(
                f"{what} {path} is a directory: name a file, e.g. "
                f"{os.path.join(path, 'events.jsonl')}"
            )
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISCHR(info.st_mode)):
            raise ValueError(f"{what} {path} is not a regular file: name a file")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC))
        except OSError as exc:
            raise ValueError(
                f"{what} {path} cannot be written ({_why(exc, path)}): name a file you can write"
            ) from None
        return
    problem = creatable(os.path.dirname(os.path.abspath(path)))
    if problem:
        raise ValueError(f"{what} {path} cannot be created: {problem}")


def creatable(directory: str) -> str:
    """Why ``directory`` (or a file in it) cannot be created by this process, or "" when it can
    as far as can be told: the nearest existing ancestor must be a directory this process may
    write to (``os.access``: root too is refused on a read-only filesystem)."""
    ancestor = os.path.abspath(directory)
    while True:
        try:
            info = os.stat(ancestor)
            break
        except FileNotFoundError:
            parent = os.path.dirname(ancestor)
            if parent == ancestor:
                return f"{ancestor} does not exist"
            ancestor = parent
        except OSError as exc:
            return f"{ancestor}: {_why(exc, ancestor)}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{ancestor} is not a directory"
    if not os.access(
        ancestor, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids
    ):
        return f"{ancestor} is not writable by this user (or is on a read-only filesystem)"
    return ""


def _why(exc: OSError, path: str) -> str:
    if exc.errno == errno.ELOOP:
        return _SYMLINK_REFUSED
    return exc.strerror or str(exc)


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


def spec_path(spec: str) -> str:
    """The file a handler spec names (``file:PATH``, ``jsonl:PATH``); "" for the others."""
    kind, path = _parse_spec(spec, "event")
    return path if kind == "jsonl" else ""


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
