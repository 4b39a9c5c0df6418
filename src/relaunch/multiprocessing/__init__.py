"""torch's ``torch.distributed.elastic.multiprocessing``, at relaunch's path: the import of a
torch program changes, nothing else. The names live in ``relaunch.procs``; this package and its
submodules (``api``, ``errors``, ``errors.error_handler``, ``errors.handlers``, ``tail_log``)
only name them where torch has them (docs/python-api.md has the whole mapping)."""

from relaunch.multiprocessing.api import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SignalException,
    Std,
    SubprocessContext,
    to_map,
)
from relaunch.multiprocessing.errors import ProcessFailure
from relaunch.procs import start_processes

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "start_processes",
    "to_map",
]
