"""Processes and their output: start a group of workers, watch them, stop them as one unit."""

from typing import TYPE_CHECKING

from relaunch.core.workers.streams import Std
from relaunch.procs.context import (
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SubprocessContext,
    start_processes,
)
from relaunch.procs.errors import ChildFailedError, SignalException, record
from relaunch.procs.logs_specs import DefaultLogsSpecs, LogsSpecs
from relaunch.runtime import lazy_attributes

if TYPE_CHECKING:
    from relaunch.core.workers.logs_dest import LogsDest
    from relaunch.procs.process_failure import ProcessFailure
    from relaunch.procs.tail import TailLog

__all__ = [
    "ChildFailedError",
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
    "TailLog",
    "record",
    "start_processes",
]

#: The names that load on first use, by the module that defines each (the launcher needs none).
_LAZY = {
    "LogsDest": "relaunch.core.workers.logs_dest",
    "ProcessFailure": "relaunch.procs.process_failure",
    "TailLog": "relaunch.procs.tail",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
