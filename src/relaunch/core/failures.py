"""What went wrong with a worker, and the report a person reads.

The root cause of a group failure is its first failure; ranks that were only stopped because of it
are listed apart, so a report never blames the innocent.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

#: How many lines of a worker's stderr a failure message carries when there is no error file.
STDERR_TAIL_LINES = 20


class Failure(Protocol):
    """The fields of a failed process that a report needs (``ProcessFailure`` has them)."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str
    timestamp: float


def signal_name(exitcode: int) -> str:
    """``SIGKILL`` for an exit code of -9; empty when the process was not killed by a signal."""
    if exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def describe_exit(exitcode: int) -> str:
    """How a process ended: ``exited with code 3`` or ``killed by SIGSEGV (signal 11)``."""
    if exitcode < 0:
        return f"killed by {signal_name(exitcode)} (signal {-exitcode})"
    return f"exited with code {exitcode}"


def message_from_error_file(data: Mapping[str, Any]) -> str:
    """The text of an error file in torch's layout, preferring the full traceback.

    Accepts ``{"message": "text"}`` and ``{"message": {"message": ..., "extraInfo":
    {"py_callstack": ...}}}``; returns ``""`` when neither shape is present.
    """
    message = data.get("message")
    if isinstance(message, str):
        return message
    if isinstance(message, Mapping):
        extra = message.get("extraInfo")
        callstack = extra.get("py_callstack") if isinstance(extra, Mapping) else None
        if isinstance(callstack, str) and callstack.strip():
            return callstack.rstrip("\n")
        text = message.get("message")
        if isinstance(text, str):
            return text
    return ""


def tail_lines(text: str, count: int = STDERR_TAIL_LINES) -> str:
    """The last ``count`` non-empty-trailing lines of ``text``."""
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-count:])


def root_cause_rank(failures: Mapping[int, Failure]) -> int:
    """The rank whose failure came first (earliest timestamp, then lowest rank)."""
    if not failures:
        raise ValueError("no failures to choose a root cause from")
    return min(failures, key=lambda rank: (failures[rank].timestamp, rank))


def _when(timestamp: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="milliseconds")


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _describe(rank: int, failure: Failure, host: str) -> str:
    head = (
        f"  rank {rank} (local_rank {failure.local_rank}, host {host}, pid {failure.pid}) "
        f"{describe_exit(failure.exitcode)} at {_when(failure.timestamp)}"
    )
    parts = [head]
    if failure.error_file:
        parts.append(f"  error file: {failure.error_file}")
    if failure.message:
        parts.append(_indent(failure.message))
    return "\n".join(parts)


def _ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def format_report(
    name: str,
    failures: Mapping[int, Failure],
    host: str,
    stopped: Iterable[int] = (),
) -> str:
    """A failure report: the root cause first, then any other failures, then the stopped ranks."""
    stopped = sorted(stopped)
    if not failures:
        return f"{name} failed, but no failure was recorded"
    first = root_cause_rank(failures)
    count = len(failures)
    summary = f"{name} failed: {count} worker{'s' if count != 1 else ''} failed"
    if stopped:
        summary += f", {len(stopped)} stopped because of it"
    sections = [summary, "Root cause (first failure):", _describe(first, failures[first], host)]
    others = sorted(rank for rank in failures if rank != first)
    if others:
        sections.append("Other failures:")
        sections.extend(_describe(rank, failures[rank], host) for rank in others)
    if stopped:
        sections.append(f"Stopped because of the failure (not failures): {_ranks(stopped)}")
    return "\n".join(sections)


#: How Python's faulthandler starts the stack dump of a process killed by SIGABRT.
FAULTHANDLER_MARK = "Fatal Python error: Aborted"


def faulthandler_dump(stderr_text: str, max_lines: int = 200) -> str:
    """The last faulthandler stack dump in ``stderr_text`` (every thread's stack), or ""."""
    start = stderr_text.rfind(FAULTHANDLER_MARK)
    if start < 0:
        return ""
    lines = stderr_text[start:].rstrip("\n").splitlines()
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines in the log)"]
    return "\n".join(lines)
