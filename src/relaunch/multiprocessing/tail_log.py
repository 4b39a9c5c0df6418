"""torch's ``torch.distributed.elastic.multiprocessing.tail_log``, at relaunch's path."""

from relaunch.procs.tail import TailLog

__all__ = ["TailLog"]
