"""torch's ``torch.distributed.elastic.multiprocessing.errors``, at relaunch's path (the names
live in ``relaunch.procs.errors``, ``ProcessFailure`` in ``relaunch.procs.process_failure``)."""

from relaunch.procs.errors import (
    ChildFailedError,
    ErrorHandler,
    get_error_handler,
    record,
)
from relaunch.procs.process_failure import ProcessFailure

__all__ = ["ChildFailedError", "ErrorHandler", "ProcessFailure", "get_error_handler", "record"]
