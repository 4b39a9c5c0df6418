"""Failures of worker processes: error files, ``@record``, and the exceptions a caller sees.

``ErrorHandler``/``get_error_handler`` are what ``@record`` does with an error (torch's names).

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
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from relaunch.core.run import failures as core_failures

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: The most bytes of an error file read (one holds a message and a traceback: a few KiB).
MAX_ERROR_FILE = 16 << 20
#: The message of a failure that left neither an error file nor a stderr log: its stderr
#: went where relaunch's own goes, so what it printed is above the report.
NO_DETAIL_HINT = (
    "its stderr went to the console, not to a log: its traceback, if it printed one, is "
    "above; to see the cause here, decorate the entrypoint with @relaunch.record, or redirect "
    "stderr (-r 2)"
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
    """A worker process that ended with a non-zero exit code, with torch's fields.

    From the error file (``@record`` wrote it): ``error_file_data`` is its JSON, ``message`` its
    "message" (the dict ``@record`` writes, or text) and ``timestamp`` its time. Without one:
    ``error_file`` is ``<N/A>``, ``error_file_data`` is ``{"message": "<NONE>"}`` (with torch's
    ``errorTraits`` after an exit code), ``message`` is ``Signal 11 (SIGSEGV) received by PID 997``
    or torch's pointer to ``@record``, and ``timestamp`` is when it ended. ``exitcode`` is negative
    when a signal killed the process.

    relaunch's own: ``details``, the failure in words for the report (the traceback, else the last
    lines of stderr or why relaunch killed it), and ``failed_at``, the precise time that breaks
    ``timestamp``'s ties (whole seconds, as torch has them).
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str | dict[str, Any] = ""
    #: Whole seconds (an int, as torch's); one given with a fraction is kept as ``failed_at``.
    timestamp: float = 0
    error_file_data: dict[str, Any] = field(default_factory=dict)
    details: str = ""
    failed_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.failed_at:
            self.failed_at = float(self.timestamp) if self.timestamp else time.time()
        self.timestamp = int(self.timestamp)
        data = self.error_file_data or read_error_file(self.error_file)
        if data:
            self.error_file_data = data
            message, timestamp = core_failures.error_data_fields(data)
            if not self.details:
                self.details = core_failures.message_from_error_file(data)
        else:
            # No error file was written: the report must not point at a file that does not exist.
            self.error_file = core_failures.NOT_AVAILABLE
            self.error_file_data = {"message": core_failures.NO_ERROR_MESSAGE}
            message, timestamp = "", None
        if self.message:
            if not self.details:
                self.details = core_failures.message_from_error_file({"message": self.message})
        elif message:
            self.message = message
        else:
            self.message = core_failures.exit_message(self.exitcode, self.pid)
            if self.exitcode >= 0:
                self.error_file_data["errorTraits"] = dict(core_failures.SYSTEM_TERMINATED_TRAITS)
        if not self.timestamp:
            self.timestamp = int(self.failed_at) if timestamp is None else timestamp

    def signal_name(self) -> str:
        """The name of the signal that killed the process, e.g. ``SIGKILL``; ``<N/A>`` for an exit
        code (``core.run.failures.signal_name`` is relaunch's, for reports)."""
        return core_failures.torch_signal_name(self.exitcode)

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as ``YYYY-MM-DDTHH:MM:SS`` with ``_`` between date and time."""
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
        """A failure whose ``details`` fall back to the stderr tail, or a hint, without an error
        file; ``timestamp`` is when the worker ended (kept precisely as ``failed_at``).

        ``stderr_tail`` is the end of the worker's stderr as relaunch read it (kept in memory),
        preferred to the log file, which may lack it (``stderr_log_error`` says why).
        """
        failure = cls(local_rank, pid, exitcode, error_file, failed_at=timestamp)
        if not failure.details:
            text = (
                read_tail(stderr_file)
                if stderr_tail is None
                else stderr_tail.decode("utf-8", errors="replace")
            )
            tail = core_failures.tail_lines(text)
            if tail:
                failure.details = core_failures.stderr_tail_message(
                    stderr_file, tail, stderr_log_error
                )
            elif not stderr_file and exitcode >= 0:
                # A worker killed by a signal cannot write an error file: the report says what
                # the signal means instead (core.run.failures.signal_meaning).
                failure.details = NO_DETAIL_HINT
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
    """The JSON an error file holds, or ``{}`` when there is none or it is not valid JSON. A
    worker writes it, so what is no error file (a FIFO, a device, more than
    ``MAX_ERROR_FILE`` bytes, JSON nested past the parser's depth) is said in a warning and read
    as none: it can neither hang nor crash the agent, nor take its memory."""
    if not path:
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if info.st_size > MAX_ERROR_FILE:
                raise ValueError(f"{info.st_size} bytes, more than an error file holds")
            data = json.loads(file.read(MAX_ERROR_FILE + 1))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("cannot read error file %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def write_error_file(path: str, data: Mapping[str, Any]) -> None:
    """Write ``data`` as JSON atomically: a reader never sees half a file, a crash never erases
    one."""
    _write_atomically(path, json.dumps(data))


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        # A full disk: no half-written temporary left behind (the failure report then takes
        # the cause from the worker's stderr, which relaunch keeps in memory).
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


#: Where relaunch's own modules are: their frames above a user's are left out of a traceback.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def callers_traceback(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback from its first frame outside relaunch (``@record``'s wrapper, a
    function worker's start): what a person reads starts at their own code. Whole when every
    frame is relaunch's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
        tb = tb.tb_next
    return exc.__traceback__ if tb is None else tb


def exception_error_data(exc: BaseException) -> dict[str, Any]:
    """The error-file content for ``exc``, in the layout torch's tools read; its traceback
    starts at the first frame outside relaunch (``callers_traceback``)."""
    import traceback

    callstack = traceback.format_exception(type(exc), exc, callers_traceback(exc))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(callstack),
                "timestamp": str(int(time.time())),
            },
        }
    }


class ErrorHandler:
    """What ``@record`` does with an error, as torch's ``ErrorHandler``: the exception goes, as
    JSON in torch's layout, to the file ``TORCHELASTIC_ERROR_FILE`` names (nothing without one).

    Subclass it to handle errors your own way (override ``initialize()`` and
    ``record_exception()``) and pass it as ``record(main, error_handler=MyHandler())``. relaunch
    writes the file atomically, and a file it cannot write is said on stderr, not raised: the
    exception being recorded is the one that must reach the caller.
    """

    def _get_error_file_path(self) -> str | None:
        """Where the error goes: ``TORCHELASTIC_ERROR_FILE``; None: nowhere."""
        return os.environ.get(ERROR_FILE_ENV)

    def initialize(self) -> None:
        """Called before the decorated function runs: enables faulthandler for every thread, so
        a crash in native code leaves the Python stacks on stderr."""
        import faulthandler

        try:
            faulthandler.enable(all_threads=True)
        except Exception as exc:
            warnings.warn(
                f"Unable to enable fault handler. {type(exc).__name__}: {exc}", stacklevel=2
            )

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        """Write ``error_msg`` (JSON text) to ``file_path``; a failure is said on stderr."""
        try:
            _write_atomically(file_path, error_msg)
        except OSError as exc:
            print(f"relaunch: cannot write error file {file_path}: {exc}", file=sys.stderr)

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` (its type, message, traceback and the time) to the error file."""
        file = self._get_error_file_path()
        if file:
            self._write_error_file(file, json.dumps(exception_error_data(e)))

    def override_error_code_in_rootcause_data(
        self,
        rootcause_error_file: str,
        rootcause_error: dict[str, Any],
        error_code: int = 0,
    ) -> None:
        """Set ``errorCode`` in the root cause's error data read from ``rootcause_error_file``
        (only the layout ``@record`` writes has a place for it)."""
        message = rootcause_error.get("message") if isinstance(rootcause_error, dict) else None
        if isinstance(message, dict):
            message["errorCode"] = error_code
        elif isinstance(message, str):
            log.warning(
                "child error file (%s) has a text message: its error code is left as it is",
                rootcause_error_file,
            )
        else:
            log.warning(
                "child error file (%s) has no message: cannot set its error code %s",
                rootcause_error_file,
                error_code,
            )

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy the root cause's error file (a worker's) to this process's error file, with
        ``errorCode`` set to ``error_code`` when it is not 0: a worker killed by a signal cannot
        say its own exit code."""
        try:
            with open(rootcause_error_file, encoding="utf-8") as file:
                rootcause_error = json.load(file)
        except (OSError, ValueError) as exc:
            where = rootcause_error_file
            print(
                f"relaunch: cannot read the root cause's error file {where}: {exc}", file=sys.stderr
            )
            return
        if error_code:
            self.override_error_code_in_rootcause_data(
                rootcause_error_file, rootcause_error, error_code
            )
        my_error_file = self._get_error_file_path()
        if not my_error_file:
            log.info(
                "no %s for this process: the root cause's error file %s is not copied",
                ERROR_FILE_ENV,
                rootcause_error_file,
            )
            return
        if os.path.isfile(my_error_file):
            # A worker that inherited this process's environment may have written here.
            log.warning(
                "%s already exists and is replaced by the root cause's %s; it held:\n%s",
                my_error_file,
                rootcause_error_file,
                read_tail(my_error_file),
            )
        self._write_error_file(my_error_file, json.dumps(rootcause_error))


def get_error_handler() -> ErrorHandler:
    """The handler ``@record`` uses when it is given none (torch's name)."""
    return ErrorHandler()


def record(fn: F | None = None, error_handler: ErrorHandler | None = None) -> Any:
    """Decorator: write an uncaught exception to the error file named by TORCHELASTIC_ERROR_FILE.

    Everything goes through ``error_handler`` (default: ``get_error_handler()``, asked when
    decorating, as torch does): ``initialize()`` before each call, ``record_exception(e)`` for an
    exception, which is re-raised, so the process still fails. ``SystemExit(0)`` is a success.
    When the function raises ``ChildFailedError`` (it launched workers itself), the root cause's
    error file is copied with ``dump_error_file(error_file, exitcode)``; a root cause without an
    error file writes nothing, so a scheduler reading the file never takes this launcher's report
    for the root cause. Use as ``@record``, ``@record()`` or ``record(main, error_handler=h)``.
    """
    handler = get_error_handler() if error_handler is None else error_handler

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            handler.initialize()
            try:
                return func(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except ChildFailedError as exc:
                rank, failure = exc.get_first_failure()
                if core_failures.has_error_file(failure):
                    handler.dump_error_file(failure.error_file, failure.exitcode)
                else:
                    log.info(
                        "rank %s failed with no error file, so none is passed up: decorate the "
                        "workers' entrypoint with @record to pass up their traceback",
                        rank,
                    )
                raise
            except Exception as exc:
                handler.record_exception(exc)
                raise

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


class ChildFailedError(Exception):
    """One or more workers failed. ``str(e)`` is a report a person can act on, root cause first.

    ``failures`` maps rank to :class:`ProcessFailure`; ``stopped`` names the ranks that were only
    stopped because of those failures (they are not failures themselves). ``requeue`` False:
    the agent stopped restarting because it could not help (no progress, the same failure
    again), so running the job again would not either.
    """

    def __init__(
        self,
        name: str,
        failures: Mapping[int, ProcessFailure],
        stopped: Iterable[int] = (),
        requeue: bool = True,
    ) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = dict(failures)
        self.stopped = sorted(stopped)
        self.requeue = requeue
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
