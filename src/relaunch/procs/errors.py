"""Failures of worker processes: error files, ``@record``, and the exceptions a caller sees.

Exceptions::

    SignalException      the launching process got SIGTERM/SIGINT/SIGHUP/SIGQUIT (has ``sigval``)
    ChildFailedError     one or more workers failed; ``str()`` is the report, root cause first
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relaunch.core import failures as core_failures

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: The message of a failure that left neither an error file nor a stderr log.
NO_DETAIL_HINT = (
    "no error file and no stderr log: decorate the entrypoint with @relaunch.record, or "
    "redirect stderr (-r 2), to see the cause here"
)

F = TypeVar("F", bound=Callable[..., Any])


class SignalException(Exception):
    """Raised in the main thread when the launching process receives a termination signal.

    Catch it, stop the workers with ``pcontext.close(e.sigval)``, and exit with 128 + signal.
    """

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


class StopRequested(SignalException):
    """The first SIGTERM or SIGINT: the agent asks its workers to stop (``stop_requested()``)
    and gives them ``shutdown_timeout`` seconds; a second signal raises ``SignalException``."""


@dataclass
class ProcessFailure:
    """A worker process that ended with a non-zero exit code.

    ``message`` is the worker's traceback when it left an error file, otherwise how it ended and the
    last lines of its stderr (when stderr went to a log file). ``exitcode`` is negative when the
    process was killed by a signal.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str = ""
    timestamp: float = 0.0
    error_file_data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.timestamp:
            self.timestamp = time.time()
        if not self.error_file_data:
            self.error_file_data = read_error_file(self.error_file)
        if not self.message:
            self.message = core_failures.message_from_error_file(self.error_file_data)
        if not self.error_file_data:
            # No error file was written: the report must not point at a file that does not exist.
            self.error_file = ""

    def signal_name(self) -> str:
        """The name of the signal that killed the process, e.g. ``SIGKILL``; empty otherwise."""
        return core_failures.signal_name(self.exitcode)

    def timestamp_isoformat(self) -> str:
        import datetime

        return datetime.datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    @classmethod
    def from_exit(
        cls,
        local_rank: int,
        pid: int,
        exitcode: int,
        error_file: str,
        stderr_file: str = "",
        timestamp: float = 0.0,
        stderr_tail: bytes | None = None,
        stderr_log_error: str = "",
    ) -> ProcessFailure:
        """A failure whose message falls back to the exit description and the stderr tail.

        ``stderr_tail`` is the end of the worker's stderr as relaunch read it (kept in memory),
        preferred to the log file, which may lack it (``stderr_log_error`` says why).
        """
        failure = cls(local_rank, pid, exitcode, error_file, timestamp=timestamp)
        if not failure.message:
            text = (
                read_tail(stderr_file)
                if stderr_tail is None
                else stderr_tail.decode("utf-8", errors="replace")
            )
            tail = core_failures.tail_lines(text)
            if tail:
                failure.message = core_failures.stderr_tail_message(
                    stderr_file, tail, stderr_log_error
                )
            elif not stderr_file and exitcode >= 0:
                # A worker killed by a signal cannot write an error file: the report says what
                # the signal means instead (core.failures.signal_meaning).
                failure.message = NO_DETAIL_HINT
        return failure


def read_tail(path: str, max_bytes: int = 64 * 1024) -> str:
    """The last ``max_bytes`` of the file at ``path`` as text; "" when there is none."""
    if not path:
        return ""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - max_bytes))
            data = file.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


def read_error_file(path: str) -> dict[str, Any]:
    """The JSON an error file holds, or ``{}`` when there is none or it is not valid JSON."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("cannot read error file %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def write_error_file(path: str, data: Mapping[str, Any]) -> None:
    """Write ``data`` atomically: a reader never sees half a file, a crash never erases one."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(temporary, path)
    except BaseException:
        # A full disk: no half-written temporary left behind (the failure report then takes
        # the cause from the worker's stderr, which relaunch keeps in memory).
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def exception_error_data(exc: BaseException) -> dict[str, Any]:
    """The error-file content for ``exc``, in the layout torch's tools read."""
    import traceback

    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }


def record(fn: F | None = None, error_handler: object = None) -> Any:
    """Decorator: write an uncaught exception to the error file named by TORCHELASTIC_ERROR_FILE.

    The exception is re-raised, so the process still fails. ``SystemExit(0)`` is a success. When
    the function raises ``ChildFailedError`` (it launched workers itself), the root cause's error
    file is passed up instead of the launcher's own traceback. Use as ``@record`` or ``@record()``.
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except SystemExit as exc:
                if exc.code in (0, None):
                    return None
                raise
            except ChildFailedError as exc:
                _record_to_env_file(exc.root_cause_error_data() or exception_error_data(exc))
                raise
            except Exception as exc:
                _record_to_env_file(exception_error_data(exc))
                raise

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


def _record_to_env_file(data: Mapping[str, Any]) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        write_error_file(path, data)
    except OSError as exc:
        print(f"relaunch: cannot write error file {path}: {exc}", file=sys.stderr)


class ChildFailedError(Exception):
    """One or more workers failed. ``str(e)`` is a report a person can act on, root cause first.

    ``failures`` maps rank to :class:`ProcessFailure`; ``stopped`` names the ranks that were only
    stopped because of those failures (they are not failures themselves).
    """

    def __init__(
        self,
        name: str,
        failures: Mapping[int, ProcessFailure],
        stopped: Iterable[int] = (),
    ) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = dict(failures)
        self.stopped = sorted(stopped)
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = core_failures.root_cause_rank(self.failures)
        return rank, self.failures[rank]

    def root_cause_error_data(self) -> dict[str, Any]:
        return self.get_first_failure()[1].error_file_data

    def format_msg(self) -> str:
        return core_failures.format_report(
            self.name, self.failures, os.uname().nodename, self.stopped
        )
