"""The ``logging`` handlers ``relaunch.events.record`` sends events to, by destination name, as
torch's ``torch.distributed.elastic.events.handlers`` has them: ``"console"`` (stderr),
``"null"`` and ``"dynamic_rendezvous"`` (dropped), and relaunch's ``"file:PATH"`` (one JSON
line per event appended to ``PATH``, as ``--event-log-handler file:PATH`` writes them)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from relaunch.core.output.status_events import parse_spec
from relaunch.jsonl_file import JsonLinesWriter

__all__ = ["get_logging_handler"]


class UnknownDestinationError(KeyError, ValueError):
    """An event destination with no handler: a KeyError as torch raises, and a ValueError as
    relaunch's other bad specs are; its message is one line."""

    def __str__(self) -> str:
        return str(self.args[0])


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is at each event (a redirect made later is followed)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stderr


class JsonLinesLoggingHandler(logging.Handler):
    """Appends each record's message as one line to a JSON-lines file (``jsonl_file``)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._writer = JsonLinesWriter(path)

    @property
    def path(self) -> str:
        return self._writer.path

    def emit(self, record: logging.LogRecord) -> None:
        self._writer.write_line(record.getMessage())

    def close(self) -> None:
        self._writer.close()
        super().close()


#: Destination name -> handler; a ``file:PATH`` destination's handler is added on first use.
_log_handlers: dict[str, logging.Handler] = {
    "console": _StderrHandler(),
    "dynamic_rendezvous": logging.NullHandler(),
    "null": logging.NullHandler(),
}


def get_logging_handler(destination: str = "null") -> logging.Handler:
    """The handler for ``destination``: ``"console"``, ``"null"``, ``"dynamic_rendezvous"`` or
    ``"file:PATH"``; ``UnknownDestinationError`` (a KeyError) for any other."""
    handler = _log_handlers.get(destination)
    if handler is not None:
        return handler
    try:
        kind, path = parse_spec(destination, "event")
    except ValueError:
        kind, path = "", ""
    if kind != "jsonl":
        raise UnknownDestinationError(
            f"no event destination {destination!r}: expected 'console', 'null', "
            "'dynamic_rendezvous', 'file:PATH' or 'jsonl:PATH'"
        )
    return _log_handlers.setdefault(destination, JsonLinesLoggingHandler(path))
