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
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from relaunch.core.run import failures as core_failures
from relaunch.runtime import lazy_attributes

if TYPE_CHECKING:
    from relaunch.core.run.culprit import Verdict
    from relaunch.procs.process_failure import ProcessFailure

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
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
            from relaunch.procs.process_failure import read_tail

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
    again), so running the job again would not either. ``verdict``: a hang's culprit, from
    every rank's stack (``core.run.culprit``), which the report names as the root cause.
    """

    def __init__(
        self,
        name: str,
        failures: Mapping[int, ProcessFailure],
        stopped: Iterable[int] = (),
        requeue: bool = True,
        verdict: Verdict | None = None,
    ) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = dict(failures)
        self.stopped = sorted(stopped)
        self.requeue = requeue
        self.verdict = verdict
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = core_failures.root_cause_rank(self.failures)
        return rank, self.failures[rank]

    def root_cause_error_data(self) -> dict[str, Any]:
        return self.get_first_failure()[1].error_file_data

    def format_msg(self) -> str:
        return core_failures.format_report(
            self.name, self.failures, os.uname().nodename, self.stopped, verdict=self.verdict
        )


#: ``ProcessFailure`` loads on first use (the worker monitor's, as the workers start).
__getattr__ = lazy_attributes(__name__, {"ProcessFailure": "relaunch.procs.process_failure"})
