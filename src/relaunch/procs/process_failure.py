"""``ProcessFailure``: a worker process that failed, with torch's fields, read from its error
file and the tail of its stderr.

Made when a worker fails (``procs.group_result``); the worker monitor loads it as the workers
start (``procs.monitor``), off the launch's way to them, where a dataclass would cost 0.5 ms
before the first worker. ``relaunch.procs.errors`` names it too, loading it on first use.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from relaunch.core.run import failures as core_failures
from relaunch.core.value import DataclassMethods

log = logging.getLogger(__name__)

#: The most bytes of an error file read (one holds a message and a traceback: a few KiB).
MAX_ERROR_FILE = 16 << 20
#: The message of a failure that left neither an error file nor a stderr log: its stderr
#: went where relaunch's own goes, so what it printed is above the report.
NO_DETAIL_HINT = (
    "its stderr went to the console, not to a log: its traceback, if it printed one, is "
    "above; to see the cause here, decorate the entrypoint with @relaunch.record, or redirect "
    "stderr (-r 2)"
)


@dataclass(repr=False, eq=False)  # DataclassMethods: not compiled at import
class ProcessFailure(DataclassMethods):
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
