"""Starting an attempt, as a plan: every rank's environment, arguments, I/O, console prefix and
CPUs, and the attempt's log directory, decided before anything starts.

``plan_attempt`` is pure: given what the run runs (``Command``), the group's place (ranks, master,
restart count), the launcher's environment and console, and the placement, it returns the
``AttemptPlan`` that the agent passes to ``start_processes`` as it is (``start_arguments``), and
that ``relaunch --dry-run`` prints instead (``agent.dry_run``). Named tuples, as the step's values
(``core.run.step_types``): made at every launch, they cost a tenth of a dataclass.
"""

# Annotations evaluated, not postponed: a named tuple's field types are then classes,
# where strings made typing compile a forward reference for each field at every start.

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT
from relaunch.core.output.console_plan import (
    agent_tee,
    console_is_relaunchs,
    console_shared,
    log_line_prefixes,
    relayed,
)
from relaunch.core.workers.macros import substitute_local_rank
from relaunch.core.workers.rank_io import RankIO, plan_rank_io
from relaunch.core.workers.ranks import GroupContext, WorkerRanks, worker_env
from relaunch.core.workers.streams import Std

if TYPE_CHECKING:
    from relaunch.core.workers.placement import Placement


class Command(NamedTuple):
    """What every attempt of a run starts: ``nprocs`` copies of ``entrypoint`` (a function or a
    binary) with ``args``, their streams as ``redirects``, ``tee`` and ``local_ranks_filter``
    (torch's: the ranks shown on the console) say, or, with ``logs_specs`` (a user's
    ``LogsSpecs``), as its ``reify`` says when the attempt starts. ``log_line_prefix_template``
    (torch's: ``${role_name}``, ``${rank}``, ``${local_rank}``) makes the console prefixes;
    the duplicate filters (torch's) copy the matching tee'd lines to one file."""

    role: str
    entrypoint: Callable[..., Any] | str
    args: tuple[Any, ...]
    nprocs: int
    redirects: Std | Mapping[int, Std] = Std.NONE
    tee: Std | Mapping[int, Std] = Std.NONE
    start_method: str = "spawn"
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    local_ranks_filter: frozenset[int] | None = None
    log_line_prefix_template: str | None = None
    logs_specs: Any = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()


class AttemptPlan(NamedTuple):
    """One attempt's workers, by local rank: what ``start_processes`` is given.

    ``envs`` holds what each worker gets on top of the launcher's environment; ``tee`` is the
    tee the workers start with (``agent_tee``), ``relay`` the streams relaunch copies
    byte for byte; ``draws_console``: no worker writes to the console itself, so relaunch may
    draw its bars there. With ``logs_specs`` (a user's ``LogsSpecs``), ``start_processes``
    asks it where the logs go, and ``log_dir``, ``redirects`` and ``tee`` are unused.
    """

    name: str
    entrypoint: Callable[..., Any] | str
    args: dict[int, tuple[Any, ...]]
    envs: dict[int, dict[str, str]]
    log_dir: str
    start_method: str
    redirects: Std | Mapping[int, Std]
    tee: Std | Mapping[int, Std]
    shutdown_timeout: float
    log_line_prefixes: dict[int, str]
    relay: dict[int, Std]
    cpu_affinity: dict[int, frozenset[int]]
    draws_console: bool
    local_ranks_filter: frozenset[int] | None = None
    logs_specs: Any = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()

    @property
    def nprocs(self) -> int:
        return len(self.envs)

    def start_arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``start_processes``. Only a relay that does something and
        CPUs that bind are given: a ``start_processes`` given by the user (torch's, say) knows
        neither."""
        arguments: dict[str, Any] = {
            "name": self.name,
            "entrypoint": self.entrypoint,
            "args": self.args,
            "envs": self.envs,
            "start_method": self.start_method,
            "shutdown_timeout": self.shutdown_timeout,
            "log_line_prefixes": self.log_line_prefixes,
        }
        if self.logs_specs is not None:
            arguments["logs_specs"] = self.logs_specs
        else:
            arguments.update(log_dir=self.log_dir, redirects=self.redirects, tee=self.tee)
        if self.local_ranks_filter:
            arguments["local_ranks_filter"] = self.local_ranks_filter
        for stream in ("stdout", "stderr"):
            needles = getattr(self, f"duplicate_{stream}_filters")
            if needles:
                arguments[f"duplicate_{stream}_filters"] = list(needles)
        if any(self.relay.values()):
            arguments["relay"] = self.relay
        if self.cpu_affinity:
            arguments["cpu_affinity"] = self.cpu_affinity
        return arguments

    def rank_args(self, local_rank: int) -> tuple[Any, ...]:
        """The arguments ``local_rank`` runs with (``${local_rank}`` replaced)."""
        return substitute_local_rank(self.args[local_rank], local_rank)

    def rank_io(self) -> dict[int, RankIO]:
        """Where each rank's streams go, as ``start_processes`` will plan them (with
        ``logs_specs``, only its ``reify`` can say: none)."""
        if self.logs_specs is not None:
            return {}
        return plan_rank_io(
            self.name,
            self.log_dir,
            self.nprocs,
            self.redirects,
            self.tee,
            self.log_line_prefixes,
            self.relay,
            self.local_ranks_filter,
        )


def plan_attempt(
    command: Command,
    group: GroupContext,
    ranks: Sequence[WorkerRanks],
    environ: Mapping[str, str],
    log_dir: str,
    *,
    extra_env: Mapping[str, str] | None = None,
    placement: "Placement | None" = None,
    terminals: Std = Std.ALL,
    hang_detection: bool = False,
) -> AttemptPlan:
    """The plan of an attempt whose group is ``group`` and whose workers hold ``ranks``, started
    from a launcher with environment ``environ``; its logs go to ``log_dir``.

    Each worker's environment is torchrun's (``core.workers.ranks.worker_env``), then its
    placement's (``CUDA_VISIBLE_DEVICES``), then ``extra_env`` (the agent's channel and timers).
    ``terminals`` names the launcher's streams that are terminals; with ``hang_detection`` the
    workers' output is read by relaunch (tee'd or relayed), never left to the workers.
    """
    extra = dict(extra_env or {})
    envs = {
        worker.local_rank: {
            **worker_env(worker, group, environ),
            **(placement.env(worker.local_rank) if placement is not None else {}),
            **extra,
        }
        for worker in ranks
    }
    nprocs = command.nprocs
    hang = hang_detection
    theirs = command.logs_specs is not None
    redirects = command.redirects
    tee = command.tee if theirs else agent_tee(command.tee, redirects, nprocs, hang, terminals)
    # A user's LogsSpecs makes no file for relaunch's tee: with hang detection relaunch reads
    # every stream it leaves on the console instead (``rank_io_of`` keeps those unlogged).
    relay = relayed(
        redirects,
        tee,
        nprocs,
        Std.NONE if theirs and hang else terminals,
        hang,
        console_shared(environ),
    )
    return AttemptPlan(
        name=command.role,
        entrypoint=command.entrypoint,
        args=dict.fromkeys(envs, command.args),
        envs=envs,
        log_dir=log_dir,
        start_method=command.start_method,
        redirects=command.redirects,
        tee=tee,
        shutdown_timeout=command.shutdown_timeout,
        log_line_prefixes=log_line_prefixes(
            command.log_line_prefix_template,
            command.role,
            ((worker.local_rank, worker.global_rank) for worker in ranks),
        ),
        relay=relay,
        cpu_affinity=placement.cpus() if placement is not None else {},
        draws_console=not theirs and console_is_relaunchs(command.redirects, tee, nprocs, relay),
        local_ranks_filter=command.local_ranks_filter,
        logs_specs=command.logs_specs,
        duplicate_stdout_filters=command.duplicate_stdout_filters,
        duplicate_stderr_filters=command.duplicate_stderr_filters,
    )
