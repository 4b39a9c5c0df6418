"""What the agent runs and how a run ended: the spec, the workers, their group and its states."""

from __future__ import annotations

import enum
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relaunch.agent.ranks import node_place
from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT, numa_binding_of
from relaunch.core.value import DataclassMethods
from relaunch.core.workers.ranks import DEFAULT_ROLE as DEFAULT_ROLE  # torch's name, said in core
from relaunch.core.workers.ranks import WorkerRanks, ranks_of
from relaunch.core.workers.streams import Std
from relaunch.rendezvous.api import RendezvousError, RendezvousHandler, RendezvousInfo

if TYPE_CHECKING:
    from relaunch.core.run.culprit import Verdict
    from relaunch.procs.process_failure import ProcessFailure


class WorkerState(str, enum.Enum):
    """The state of a worker group (all workers of one node move together)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass(repr=False, eq=False)  # DataclassMethods: not compiled at import
class WorkerSpec(DataclassMethods):
    """What to run on this node: the entrypoint, how many copies, and the restart budget.

    ``entrypoint`` is a function (run with multiprocessing) or a binary path; ``args`` are passed
    to every worker, with ``${local_rank}`` replaced by its local rank. ``monitor_interval`` is
    how often a rendezvous handler that cannot report membership changes is asked for them;
    everything else is an event.

    The fields are torch 2.13's, in its order, then relaunch's own (by keyword). ``fn``: torch's
    deprecated alias of ``entrypoint`` (a DeprecationWarning; it wins over ``entrypoint``, as in
    torch). ``event_log_handler``: where the agent records its events (``relaunch.events.record``
    destinations) when it is given no ``event_handler``. ``numa_options``: torch's
    ``NumaOptions``, as relaunch's NUMA binding of the same mode. ``virtual_local_rank``: every
    worker gets ``LOCAL_RANK=0`` and sees only its own GPU (``CUDA_VISIBLE_DEVICES``).
    """

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    fn: Callable[..., Any] | None = None
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    #: torch's: copy the tee'd stdout (stderr) lines that contain any of these strings to the
    #: attempt's ``filtered_stdout.log`` (``filtered_stderr.log``).
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT

    def __post_init__(self) -> None:
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.fn:
            if isinstance(self.entrypoint, tuple):  # relaunch's old order: (entrypoint, args)
                raise ValueError(
                    "WorkerSpec's 4th field is fn (torch's order: role, local_world_size, "
                    "rdzv_handler, fn, entrypoint, args): give entrypoint= and args= by keyword"
                )
            warnings.warn(
                "WorkerSpec.fn is deprecated: use WorkerSpec.entrypoint",
                DeprecationWarning,
                stacklevel=3,  # the caller of the dataclass' __init__
            )
            self.entrypoint = self.fn
        if self.entrypoint is None:
            raise ValueError("WorkerSpec needs an entrypoint: a function or a binary")
        if self.numa_options is not None:
            numa_binding_of(self.numa_options)  # a mode relaunch cannot bind: say so now

    def get_entrypoint_name(self) -> str:
        """The function's name, the script a Python interpreter runs, or the binary's name."""
        entrypoint = self.entrypoint
        if callable(entrypoint):
            return getattr(entrypoint, "__name__", repr(entrypoint))
        assert isinstance(entrypoint, str)
        if entrypoint == sys.executable:
            script = next((str(a) for a in self.args if not str(a).startswith("-")), "")
            if script:
                return os.path.basename(script)
        return os.path.basename(entrypoint)


class Worker:
    """One worker of the group; ranks are -1 until a rendezvous assigned them.

    A plain class, as torch's is (a dataclass costs every launch 0.3 ms to make), compared and
    shown by its fields as a dataclass is.
    """

    __slots__ = ("global_rank", "id", "local_rank", "role_rank", "role_world_size", "world_size")
    #: Its fields in the order of its ``__init__`` (``__slots__`` is kept sorted).
    __match_args__ = (
        "local_rank",
        "global_rank",
        "role_rank",
        "world_size",
        "role_world_size",
        "id",
    )

    def __init__(
        self,
        local_rank: int,
        global_rank: int = -1,
        role_rank: int = -1,
        world_size: int = -1,
        role_world_size: int = -1,
        id: int | None = None,
    ) -> None:
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.role_rank = role_rank
        self.world_size = world_size
        self.role_world_size = role_world_size
        self.id = id

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__match_args__)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, Worker)
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__match_args__)
        return f"Worker({shown})"


class WorkerGroup:
    """The workers of one ``WorkerSpec`` on this node, and their shared place in the job."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Any = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT
        self.ranks: list[WorkerRanks] = []

    def join(self, info: RendezvousInfo) -> None:
        """Take this node's place from a completed rendezvous (``info``: relaunch's or torch's
        ``RendezvousInfo``): the group's and every worker's (``agent.ranks``)."""
        spec = self.spec
        master = info.bootstrap_store_info
        master_addr = spec.master_addr or (master.master_addr if master else None)
        master_port = spec.master_port or (master.master_port if master else None)
        if not master_addr or not master_port:
            raise RendezvousError(
                "the rendezvous handler did not say where the workers' store is "
                "(bootstrap_store_info): return a RendezvousStoreInfo from next_rendezvous, or "
                "give the WorkerSpec a master_addr and master_port"
            )
        place = node_place(info, spec.role, spec.local_world_size)
        self.store = info.store
        self.group_rank = info.rank
        self.group_world_size = info.world_size
        self.master_addr, self.master_port = master_addr, master_port
        self.ranks = ranks_of(place, spec.local_world_size)
        for worker, ranks in zip(self.workers, self.ranks, strict=True):
            worker.global_rank = ranks.global_rank
            worker.role_rank = ranks.role_rank
            worker.world_size = ranks.world_size
            worker.role_world_size = ranks.role_world_size

    def by_global_rank(self, by_local_rank: Mapping[int, Any]) -> dict[int, Any]:
        """``by_local_rank`` keyed by the workers' global ranks instead."""
        return {self.workers[local].global_rank: value for local, value in by_local_rank.items()}


@dataclass(repr=False, eq=False)
class RunResult(DataclassMethods):
    """How a run ended. ``return_values`` and ``failures`` are keyed by global rank;
    ``stopped`` lists the global ranks stopped only because another failed; ``verdict``: a
    hang's culprit, from every rank's stack (``core.run.culprit``), or ""."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)
    verdict: Verdict | None = None

    def is_failed(self) -> bool:
        return self.state is WorkerState.FAILED
