"""torch's ``torch.distributed.elastic.multiprocessing.errors``, at relaunch's path (the names
live in ``relaunch.procs.errors``)."""

from relaunch.procs.errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
    get_error_handler,
    record,
)

__all__ = ["ChildFailedError", "ErrorHandler", "ProcessFailure", "get_error_handler", "record"]
