"""torch's ``torch.distributed.elastic.multiprocessing.errors.handlers``, at relaunch's path.

As in torch, ``@record`` asks ``relaunch.procs.errors.get_error_handler`` (its own module's)
for the handler: replacing the name here does not change what ``@record`` uses.
"""

from relaunch.procs.errors import get_error_handler

__all__ = ["get_error_handler"]
