"""What went wrong with a worker, and the report a person reads.

The root cause of a group failure is its first failure; ranks that were only stopped because of it
are listed apart, so a report never blames the innocent.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from relaunch.core.run.culprit import Verdict

#: What torch's ``ProcessFailure`` says where a field has no value: ``error_file`` without an
#: error file, ``signal_name()`` without a signal.
NOT_AVAILABLE = "<N/A>"
#: The ``message`` of torch's ``error_file_data`` when there was no error file.
NO_ERROR_MESSAGE = "<NONE>"
#: torch's ``ProcessFailure.message`` for a process that exited with a code and left no error file
#: (relaunch's report says more: ``ProcessFailure.details``).
TRACEBACK_HINT = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
#: The ``errorTraits`` torch adds to the error data of such a process.
SYSTEM_TERMINATED_TRAITS = {"category": "system_terminated_error", "retryability": "False"}

#: How many lines of a worker's stderr a failure message carries when there is no error file.
STDERR_TAIL_LINES = 20
#: How a failure message made of the worker's last stderr lines begins.
STDERR_TAIL_HEADING = "last lines of stderr"

#: What a signal that ends a worker usually means. Killed by a signal, a process runs no Python
#: code on its way out, so it leaves no error file: the report says this instead.
SIGNAL_MEANINGS = {
    "SIGKILL": (
        "killed from outside, most often by the out-of-memory killer (see dmesg) or a scheduler"
    ),
    "SIGSEGV": "a crash in native code (an invalid memory access), e.g. in an extension or driver",
    "SIGABRT": (
        "aborted by native code: a failed C/C++ assertion, an uncaught C++ exception or "
        "corrupted memory"
    ),
    "SIGBUS": "a bad memory access, often a full /dev/shm (shared memory) or a truncated file",
    "SIGFPE": "an arithmetic fault in native code, e.g. an integer division by zero",
    "SIGILL": "an illegal instruction: native code built for another CPU",
    "SIGTERM": "asked to stop from outside: a scheduler, a preemption or a person",
    "SIGINT": "interrupted (Ctrl-C)",
    "SIGHUP": "its terminal or session went away",
    "SIGPIPE": "it wrote to a pipe or socket whose reader had gone",
    "SIGXCPU": "it went over its CPU time limit",
}


#: A place in a Python traceback: ``File "train.py", line 12, in step``. The patterns of this
#: module are compiled where first used (``re`` keeps them): only a failure needs them, and each
#: compile costs every launch about 0.1 ms.
_FRAME = r'File "[^"\n]*", line \d+, in [^\n]*'


class Failure(Protocol):
    """The fields of a failed process that a report needs (``ProcessFailure`` has them).

    ``details`` is the failure in relaunch's words (traceback, stderr tail, why relaunch killed
    it); ``timestamp`` is torch's whole seconds, ``failed_at`` the precise time that breaks ties.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    details: str

    @property
    def timestamp(self) -> float: ...

    @property
    def failed_at(self) -> float: ...


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


def signal_meaning(exitcode: int) -> str:
    """``SIGKILL: killed from outside, ...`` for an exit code of -9; "" for an exit code, or for a
    signal without a usual meaning."""
    name = signal_name(exitcode)
    meaning = SIGNAL_MEANINGS.get(name)
    return f"{name}: {meaning}" if meaning else ""


def stderr_tail_message(path: str, tail: str, log_error: str = "") -> str:
    """A failure message made of the last lines of the worker's stderr, logged at ``path``
    ("": not logged); ``log_error`` says why that log lacks them (they were kept in memory)."""
    if log_error:
        where = f"kept in memory: {path} is incomplete, {log_error}" if path else "kept in memory"
    else:
        where = path or "kept in memory"
    return f"{STDERR_TAIL_HEADING} ({where}):\n{tail}"


#: A Python warning as ``warnings`` prints it: ``path:line: CategoryWarning: text``, then the
#: line of source it names, indented.
_WARNING = r"^\S.*:\d+: \w*Warning: "


def headline(message: str) -> str:
    """The line of a failure message that says most on its own, for a one-line reason.

    That is the first line, unless it is a heading (it ends with ``:``) such as
    ``last lines of stderr (...):`` or ``Traceback (most recent call last):``: then the last
    non-empty line (where a Python traceback names its exception) that is not part of a
    Python warning (a worker killed by a signal after a ``FutureWarning`` did not die of it);
    "" for a bare heading.
    """
    lines = [line for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    if not lines[0].rstrip().endswith(":"):
        return lines[0]
    said = _without_warnings(lines[1:])
    return said[-1].strip() if said else ""


def _without_warnings(lines: list[str]) -> list[str]:
    """``lines`` less the Python warnings among them (each with its indented source lines)."""
    kept: list[str] = []
    in_warning = False
    for line in lines:
        if re.match(_WARNING, line):
            in_warning = True
        elif not (in_warning and line.startswith(" ")):
            in_warning = False
            kept.append(line)
    return kept


def failure_signature(failure: Failure) -> str:
    """What tells one failure from another regardless of when and where it happened: its
    exception line (or how the process ended) and the last place of its traceback, if any."""
    why = headline(failure.details) or describe_exit(failure.exitcode)
    frames = re.findall(_FRAME, failure.details)
    return f"{why} at {frames[-1]}" if frames else why


def one_line(rank: int, failure: Failure, width: int = 160) -> str:
    """A failure in one line: ``rank 1 exited with code 3: ValueError: boom``."""
    why = headline(failure.details)
    if len(why) > width:
        why = why[: width - 3] + "..."
    return f"rank {rank} {describe_exit(failure.exitcode)}" + (f": {why}" if why else "")


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


def error_data_fields(data: Mapping[str, Any]) -> tuple[Any, int | None]:
    """torch's ``message`` and ``timestamp`` of an error file's JSON ``data``: its "message" as it
    is (text, or the dict ``@record`` writes) and its timestamp in seconds (None: it has none)."""
    message = data.get("message", "")
    if isinstance(message, Mapping):
        extra = message.get("extraInfo")
        raw = extra.get("timestamp") if isinstance(extra, Mapping) else None
    else:
        raw = data.get("timestamp")
    try:
        return message, None if raw is None else int(float(raw))
    except (TypeError, ValueError, OverflowError):
        return message, None


def exit_message(exitcode: int, pid: int) -> str:
    """torch's ``ProcessFailure.message`` when the error file says nothing: the signal and pid
    (``Signal 11 (SIGSEGV) received by PID 997``) or, for an exit code, the pointer to @record."""
    if exitcode < 0:
        return f"Signal {-exitcode} ({torch_signal_name(exitcode)}) received by PID {pid}"
    return TRACEBACK_HINT


def torch_signal_name(exitcode: int) -> str:
    """torch's ``ProcessFailure.signal_name()``: ``SIGSEGV`` for -11; ``<N/A>`` for an exit code
    or a number that names no signal."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            pass
    return NOT_AVAILABLE


def has_error_file(failure: Failure) -> bool:
    """Whether ``failure`` names an error file (torch says ``<N/A>`` when there was none)."""
    return failure.error_file not in ("", NOT_AVAILABLE)


def tail_lines(text: str, count: int = STDERR_TAIL_LINES) -> str:
    """The last ``count`` non-empty-trailing lines of ``text``."""
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-count:])


def root_cause_rank(failures: Mapping[int, Failure]) -> int:
    """The rank whose failure came first: the earliest timestamp (as torch picks it; whole
    seconds), then the earliest precise time, then the lowest rank."""
    if not failures:
        raise ValueError("no failures to choose a root cause from")
    return min(
        failures, key=lambda rank: (failures[rank].timestamp, failures[rank].failed_at, rank)
    )


def _when(timestamp: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="milliseconds")


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _describe(rank: int, failure: Failure, host: str) -> str:
    head = (
        f"  rank {rank} (local_rank {failure.local_rank}, host {host}, pid {failure.pid}) "
        f"{describe_exit(failure.exitcode)} at {_when(failure.failed_at or failure.timestamp)}"
    )
    parts = [head]
    if has_error_file(failure):
        parts.append(f"  error file: {failure.error_file}")
    meaning = signal_meaning(failure.exitcode)
    details = failure.details
    # Said unless the details already explain the signal (relaunch's watchdog sent it).
    if meaning and (not details or details.startswith(STDERR_TAIL_HEADING)):
        parts.append(_indent(meaning))
    if details:
        parts.append(_indent(details))
    return "\n".join(parts)


def _ranks(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def format_report(
    name: str,
    failures: Mapping[int, Failure],
    host: str,
    stopped: Iterable[int] = (),
    kept: Iterable[int] = (),
    verdict: Verdict | None = None,
) -> str:
    """A failure report: the root cause first, then any other failures, then the stopped ranks
    (``kept``: those of them that wait to restart in place, ``relaunch.restart_in_place``).
    ``verdict``: a hang's, from every rank's stack (``core.run.culprit``): the root cause is
    the rank it names (on this node or another), else the first failure."""
    waiting = sorted(kept)
    stopped = sorted(set(stopped) - set(waiting))
    if not failures:
        return f"{name} failed, but no failure was recorded"
    count = len(failures)
    summary = f"{name} failed: {count} worker{'s' if count != 1 else ''} failed"
    if stopped or waiting:
        summary += f", {len(stopped) + len(waiting)} stopped because of it"
    sections = [summary]
    if verdict is None:
        first: int | None = root_cause_rank(failures)
        sections.append("Root cause (first failure):")
    else:
        here = [rank for rank in verdict.culprits if rank in failures]
        first = here[0] if here else None if verdict.culprits else root_cause_rank(failures)
        sections.append(f"Root cause (a hang, from every rank's stack): {verdict.line}")
        if first is None:
            sections.append("  not on this node: its report there shows the stack")
    if first is not None:
        sections.append(_describe(first, failures[first], host))
    others = sorted(rank for rank in failures if rank != first)
    if others:
        sections.append("Other failures:")
        sections.extend(_describe(rank, failures[rank], host) for rank in others)
    if stopped:
        they = "it" if len(stopped) == 1 else "them"
        cause = "the failure" if count == 1 else "the failures"
        sections.append(
            f"{_ranks(stopped).capitalize()} did not fail: relaunch stopped {they} "
            f"because of {cause} above"
        )
    if waiting:
        sections.append(
            f"{_ranks(waiting).capitalize()} did not fail: "
            f"{'it waits' if len(waiting) == 1 else 'they wait'} to restart in place"
        )
    return "\n".join(sections)


#: How Python's faulthandler starts the stack dump of a process killed by SIGABRT.
FAULTHANDLER_MARK = "Fatal Python error: Aborted"


#: A stack dump's line for a main thread that returned and waits, at interpreter exit, for the
#: non-daemon threads to end (``threading._shutdown`` joins them).
_AT_EXIT_FRAME = r'threading\.py", line \d+ in _shutdown$'
#: What a hang report says when the stack shows that.
AT_EXIT = (
    "it hung at exit: its main thread had returned and was waiting in threading._shutdown "
    "for a non-daemon thread to end (the threads' stacks below show which, and on what)"
)


def waits_at_exit(dump: str) -> bool:
    """Whether the faulthandler ``dump`` shows the interpreter waiting at exit for threads."""
    return re.search(_AT_EXIT_FRAME, dump, re.MULTILINE) is not None


def faulthandler_dump(stderr_text: str, max_lines: int = 200) -> str:
    """The last faulthandler stack dump in ``stderr_text`` (every thread's stack), or ""."""
    start = stderr_text.rfind(FAULTHANDLER_MARK)
    if start < 0:
        return ""
    lines = stderr_text[start:].rstrip("\n").splitlines()
    if len(lines) > max_lines:
        lines = [*lines[:max_lines], f"... ({len(lines) - max_lines} more lines in the log)"]
    return "\n".join(lines)
