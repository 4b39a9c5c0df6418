"""torch's ``torch.distributed.elastic.multiprocessing.errors.error_handler``, at relaunch's
path."""

from relaunch.procs.errors import ErrorHandler

__all__ = ["ErrorHandler"]
