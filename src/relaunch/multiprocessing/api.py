"""torch's ``torch.distributed.elastic.multiprocessing.api``, at relaunch's path (the names live
in ``relaunch.procs`` and ``relaunch.core.workers.streams``)."""

from __future__ import annotations

from collections.abc import Mapping

from relaunch.core.workers.streams import Std, per_rank
from relaunch.procs import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SignalException,
    SubprocessContext,
)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "to_map",
]


def to_map(val_or_map: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """One ``Std`` per local rank: ``val_or_map`` for all, or a map's value (``Std.NONE`` for
    the ranks it leaves out); ``relaunch.core.workers.streams.per_rank`` under torch's name."""
    return per_rank(val_or_map, local_world_size)
