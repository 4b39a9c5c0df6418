"""torch's ``torch.distributed.elastic.multiprocessing.tail_log``, at relaunch's path."""

from relaunch.procs.tail import TailLog, tail_logfile

__all__ = ["TailLog", "tail_logfile"]
