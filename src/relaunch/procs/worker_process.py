"""A started worker as the group's monitor tracks it (``WorkerProcess``), and what the group's
first failure asks before the others are stopped (``FailureGrace``)."""

from __future__ import annotations

from collections.abc import Callable

from relaunch.procs.handles import PopenHandle, ProcessHandle
from relaunch.procs.rank_streams import TeeStream
from relaunch.procs.returns import ReturnReader


class FailureGrace:
    """What a group's first failure asks before the others are stopped (the agent's
    just-in-time save, ``agent.state``). The default holds nothing."""

    def begin(self, running: set[int], release: Callable[[], None]) -> float:
        """A worker failed while the local ranks ``running`` run: how many seconds their stop
        may wait (0: stop them now); ``release()`` stops them sooner."""
        return 0.0

    def exited(self, local_rank: int) -> None:
        """A worker ended while the stop waited."""


class WorkerProcess:
    """A started worker as the monitor tracks it (a plain class: it changes as the worker runs,
    and the launcher makes it at every start, where a dataclass costs its ``exec``)."""

    __slots__ = (
        "ended_at",
        "exit_time",
        "exitcode",
        "handle",
        "kept",
        "local_rank",
        "result",
        "streams",
    )

    def __init__(
        self,
        local_rank: int,
        handle: PopenHandle | ProcessHandle,
        streams: list[TeeStream] | None = None,
        result: ReturnReader | None = None,
        exitcode: int | None = None,
        exit_time: float = 0.0,
        ended_at: float = 0.0,
        kept: bool = False,
    ) -> None:
        self.local_rank = local_rank
        self.handle = handle
        self.streams: list[TeeStream] = [] if streams is None else streams
        #: The read end of its return value's pipe (function workers); kept, closed, once read.
        self.result = result
        self.exitcode = exitcode
        #: When it ended (``time.time()``): its exit fd said so, even where its status came later.
        self.exit_time = exit_time
        #: When its exit fd said it ended while its status was not there yet (0.0: not so).
        self.ended_at = ended_at
        #: It waits to restart in place (``GroupMonitor.keep``): ended for this group, still
        #: alive, and neither signalled nor released by it.
        self.kept = kept

    def __repr__(self) -> str:
        return (
            f"WorkerProcess(local_rank={self.local_rank}, pid={self.pid}, "
            f"exitcode={self.exitcode}, kept={self.kept})"
        )

    @property
    def pid(self) -> int:
        return self.handle.pid


#: The first and the longest delay between looks at a worker whose exit was signalled but
#: which cannot be reaped yet (``GroupMonitor._set_aside``).
RECHECK_FIRST = 0.005
RECHECK_MAX = 0.5


class Unreaped:
    """The workers whose exit was signalled but that cannot be reaped yet, by local rank, and
    when to look at them again (``at``, monotonic; None: no look due): after a delay that
    doubles from ``RECHECK_FIRST`` up to ``RECHECK_MAX`` while any is left."""

    def __init__(self) -> None:
        self.workers: dict[int, WorkerProcess] = {}
        self.at: float | None = None
        self._delay = RECHECK_FIRST

    def add(self, worker: WorkerProcess, now: float) -> None:
        if not self.workers:
            self._delay = RECHECK_FIRST
        self.workers[worker.local_rank] = worker
        self.at = now + self._delay
        self._delay = min(2 * self._delay, RECHECK_MAX)

    def take_all(self) -> list[WorkerProcess]:
        """The workers to look at again now (each one still unreaped is ``add``ed back)."""
        self.at = None
        return list(self.workers.values())
