"""The outcome of a group (``RunProcsResult``) and the failures it is made of: a worker's exit,
a return value that cannot be loaded, the monitor's own failure."""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relaunch.core.value import DataclassMethods
from relaunch.core.workers.rank_io import RankIO
from relaunch.procs.errors import exception_error_data, write_error_file
from relaunch.procs.handles import StuckWorker
from relaunch.procs.monitor import GroupMonitor
from relaunch.procs.worker_process import WorkerProcess

if TYPE_CHECKING:
    from relaunch.procs.process_failure import ProcessFailure

log = logging.getLogger(__name__)


@dataclass(repr=False, eq=False)  # DataclassMethods: not compiled at import
class RunProcsResult(DataclassMethods):
    """The outcome of a finished group.

    ``return_values`` maps local rank to what a function returned (None for binaries) when all
    succeeded; ``failures`` holds the workers that failed; ``stopped`` maps the ranks that were
    stopped only because another failed to their exit codes. ``stdouts``/``stderrs`` are the log
    file paths ("" where a stream was not redirected). ``exitcodes`` and ``durations``
    (seconds from the group's start to each exit) cover every rank. ``stuck`` holds the
    stopped ranks whose process outlived its SIGKILL past ``KILL_DEADLINE`` (their exit code
    reads -SIGKILL, though nothing saw them exit): the pid and state relaunch left them in.
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    stopped: dict[int, int] = field(default_factory=dict)
    exitcodes: dict[int, int] = field(default_factory=dict)
    durations: dict[int, float] = field(default_factory=dict)
    stuck: dict[int, StuckWorker] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


def worker_failure(rank: int, worker: WorkerProcess, io: RankIO) -> ProcessFailure:
    """The failure of ``worker``: its stderr tail comes from memory when relaunch read that
    stream (its log file may lack it: a full disk), else from the log file."""
    stderr = next((stream for stream in worker.streams if stream.err), None)
    from relaunch.procs.process_failure import ProcessFailure  # a failure: loaded for one

    return ProcessFailure.from_exit(
        rank,
        worker.pid,
        worker.exitcode or 0,
        io.error_file,
        stderr_file=io.stderr,
        timestamp=worker.exit_time,
        stderr_tail=None if stderr is None else stderr.stderr_tail(),
        stderr_log_error="" if stderr is None else stderr.log_error,
    )


def unloadable(
    rank: int, worker: WorkerProcess, error: Exception, error_file: str
) -> ProcessFailure:
    """The failure of a rank whose return value cannot be loaded; its error file says why
    (it is the root cause a scheduler reads)."""
    data = exception_error_data(error)
    cause = error.__cause__
    if cause is not None:  # where loading failed (a __setstate__, an import), then why
        data["message"]["extraInfo"]["py_callstack"] = "".join(
            [*traceback.format_exception(cause), "\n", data["message"]["message"], "\n"]
        )
    try:
        write_error_file(error_file, data)
        written = True
    except OSError as exc:
        log.warning("cannot write error file %s: %s", error_file, exc)
        written = False
    from relaunch.procs.process_failure import ProcessFailure

    failure = ProcessFailure.from_exit(
        rank, worker.pid, worker.exitcode or 0, error_file, timestamp=worker.exit_time
    )
    if not written:
        failure.message = failure.details = f"{type(error).__name__}: {error}"
    return failure


def monitor_failure_result(
    monitor: GroupMonitor, stdouts: dict[int, str], stderrs: dict[int, str]
) -> RunProcsResult:
    """Every rank failed: the thread that watched them failed, and they were killed."""
    error = monitor.failure
    why = f"relaunch's worker monitor failed ({type(error).__name__}: {error})"
    workers = monitor.workers
    from relaunch.procs.process_failure import ProcessFailure

    return RunProcsResult(
        failures={
            rank: ProcessFailure(
                rank,
                worker.pid,
                worker.exitcode if worker.exitcode is not None else -signal.SIGKILL,
                "",
                message=f"{why}; the workers were killed",
                timestamp=worker.exit_time,
            )
            for rank, worker in workers.items()
        },
        stdouts=stdouts,
        stderrs=stderrs,
        exitcodes={rank: worker.exitcode or 0 for rank, worker in workers.items()},
    )
