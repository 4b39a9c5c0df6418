"""``relaunch --dry-run``: the plan of the first attempt (each rank's environment and command),
printed, with nothing started, as torchx's dry run prints its request.

The plan is the one the agent would pass to ``start_processes`` (``core.workers.attempt``). Where
the rendezvous has not said them yet (an elastic backend: the join places the node), the values that
depend on the group are shown as placeholders, and the text says it stopped before joining. The
static backend, and one node, know their ranks up front.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relaunch.core.channel import CHANNEL_ENV
from relaunch.core.defaults import DEFAULT_SHUTDOWN_TIMEOUT
from relaunch.core.workers.attempt import AttemptPlan, Command, plan_attempt
from relaunch.core.workers.placement import format_cpu_list
from relaunch.core.workers.rank_io import DEVNULL, RankIO
from relaunch.core.workers.ranks import GroupContext, ranks_at_offset
from relaunch.core.workers.streams import Std
from relaunch.core.workers.timers import TIMER_FILE_ENV

if TYPE_CHECKING:
    from relaunch.config import LaunchConfig
    from relaunch.core.workers.placement import Placement

#: What the join decides, shown where a value waits for it.
AT_THE_JOIN = "<set at the join>"
#: The variables whose values the rendezvous gives (the node's place in the group).
GROUP_VARIABLES = (
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
)
#: The static backend's master port when none is given (``rendezvous.static``).
STATIC_DEFAULT_PORT = 29500


@dataclass(frozen=True)
class FirstAttempt:
    """The first attempt's plan, and what the dry run could not know before joining (``""``:
    nothing, the ranks are known)."""

    plan: AttemptPlan
    where: str
    stopped_before: str = ""


def dry_run(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any],
    environ: Mapping[str, str] | None = None,
    placement: Placement | None = None,
    group_env: Mapping[str, str] | None = None,
    where: str | None = None,
) -> str:
    """The text ``relaunch --dry-run`` prints: the plan of this node's first attempt of the job
    ``config`` describes, running ``entrypoint`` with ``args`` in the launcher's environment
    ``environ`` (default: this process's), its ranks placed by ``placement``
    (``relaunch.placement.placement_for``). ``group_env``: what a replica group's agent adds to
    the launcher's environment, shown with each rank's; ``where``: where the node joins, when
    the config does not say it. Starts, binds and joins nothing."""
    first = first_attempt(config, entrypoint, args, environ, placement, group_env)
    if where is not None:
        first = FirstAttempt(first.plan, where, first.stopped_before)
    text = describe_first(first)
    if config.preload:
        text += (
            f"relaunch: --preload {','.join(config.preload)}: each Python worker is forked from "
            "a process that imported them once (started cold where it cannot be)\n"
        )
    return text


def first_attempt(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any],
    environ: Mapping[str, str] | None = None,
    placement: Placement | None = None,
    group_env: Mapping[str, str] | None = None,
) -> FirstAttempt:
    """The plan of the first attempt on this node, from ``config`` (and ``placement``) alone."""
    from relaunch.agent.expiry import ExpiryWatch, timers_enabled_by_env
    from relaunch.procs.console import terminals_of

    environ = os.environ if environ is None else environ
    nproc = config.nproc_per_node
    run_id = config.run_id or "<a fresh run id>"
    known, group_rank, nodes, master_addr, master_port = _place(config)
    group = GroupContext(
        role=config.role,
        run_id=run_id,
        group_rank=group_rank,
        group_world_size=nodes,
        local_world_size=nproc,
        master_addr=master_addr,
        master_port=master_port,
        restart_count=0,
        max_restarts=config.max_restarts,
        use_agent_store=True,  # served by group rank 0's agent (where it can bind the port)
    )
    extra_env = ExpiryWatch(run_id, False, config.hang_timeout).worker_env()
    timers = timers_enabled_by_env() if config.timers is None else config.timers
    if timers:
        extra_env[TIMER_FILE_ENV] = environ.get(TIMER_FILE_ENV) or "<a FIFO made at the start>"
    extra_env[CHANNEL_ENV] = "<a shared-memory file made at the start>"
    extra_env.update(group_env or {})
    plan = plan_attempt(
        _command_of(config, entrypoint, args),
        group,
        ranks_at_offset(group_rank * nproc, nproc, nodes * nproc),
        environ,
        os.path.join(
            config.log_dir or "<a new temporary directory>", f"{run_id}_<random>", "attempt_0"
        ),
        extra_env=extra_env,
        placement=placement,
        terminals=terminals_of(sys.stdout, sys.stderr),
        hang_detection=config.hang_timeout is not None,
    )
    backend = config.rdzv_backend
    where = f"the {backend} rendezvous at {config.rdzv_endpoint or '<no endpoint>'}"
    if known == GROUP_VARIABLES:
        return FirstAttempt(plan, where)
    unknown = [name for name in GROUP_VARIABLES if name not in known]
    envs = {
        rank: {name: AT_THE_JOIN if name in unknown else value for name, value in env.items()}
        for rank, env in plan.envs.items()
    }
    return FirstAttempt(plan._replace(envs=envs), where, f"the join gives {', '.join(unknown)}")


def _command_of(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: Sequence[Any]
) -> Command:
    """What each rank of the job ``config`` describes runs, and how its output goes."""
    return Command(
        role=config.role,
        entrypoint=entrypoint,
        args=tuple(args),
        nprocs=config.nproc_per_node,
        redirects=config.redirects,
        tee=config.tee,
        start_method=config.start_method,
        shutdown_timeout=DEFAULT_SHUTDOWN_TIMEOUT
        if config.shutdown_timeout is None
        else config.shutdown_timeout,
        local_ranks_filter=config.local_ranks_filter,
        log_line_prefix_template=config.log_line_prefix_template,
        logs_specs=config.logs_specs,
    )


def _place(config: LaunchConfig) -> tuple[tuple[str, ...], int, int, str, int]:
    """What the configuration alone tells of this node's place: the variables it settles, the
    group rank, the number of nodes, the master's address and port (stand-ins where unknown)."""
    if config.rdzv_backend == "static":
        from relaunch.endpoints import parse_endpoint

        host, port = parse_endpoint(config.rdzv_endpoint, default_port=STATIC_DEFAULT_PORT)
        rank = config.rendezvous_settings.rank or 0
        if port == 0:  # one node: a free port, picked as it joins
            return _without("MASTER_PORT"), rank, config.max_nodes, host, 0
        return GROUP_VARIABLES, rank, config.max_nodes, host, port
    if config.max_nodes == 1:  # one node (--standalone): the ranks are known, not the master
        return _without("MASTER_ADDR", "MASTER_PORT"), 0, 1, "", 0
    return (), 0, 1, "", 0


def _without(*names: str) -> tuple[str, ...]:
    return tuple(name for name in GROUP_VARIABLES if name not in names)


def describe_first(first: FirstAttempt) -> str:
    """The dry run's text: where the node joins, then each rank (``describe``)."""
    plan = first.plan
    lines = [
        f"relaunch: dry run of {first.where}: the first attempt of {plan.nprocs} worker(s) on "
        "this node (nothing was started)",
        describe(plan),
    ]
    if first.stopped_before:
        lines.append(f"relaunch: stopped before joining the rendezvous ({first.stopped_before})")
    return "\n".join(lines) + "\n"


def describe(plan: AttemptPlan) -> str:
    """Each rank of ``plan``: its command, its output, its CPUs and the variables it gets on top
    of the launcher's environment, one per line."""
    specs = plan.logs_specs
    if specs is None:
        lines = [f"log directory: {plan.log_dir}"]
    else:
        lines = [f"log directory: where {type(specs).__name__}.reify says at each attempt"]
    io = plan.rank_io()
    for rank, env in plan.envs.items():
        lines.append(f"local rank {rank} (rank {env.get('RANK', '?')}):")
        lines.append(f"  command: {_command(plan, rank)}")
        if rank in io:
            lines.append(f"  stdout: {_stream(io[rank], Std.OUT)}")
            lines.append(f"  stderr: {_stream(io[rank], Std.ERR)}")
        cpus = plan.cpu_affinity.get(rank)
        if cpus is not None:
            lines.append(f"  cpus: {format_cpu_list(cpus)}")
        lines.append("  environment:")
        lines.extend(f"    {name}={value}" for name, value in env.items())
    return "\n".join(lines)


def _command(plan: AttemptPlan, rank: int) -> str:
    args = plan.rank_args(rank)
    if isinstance(plan.entrypoint, str):
        return shlex.join([plan.entrypoint, *map(str, args)])
    name = getattr(plan.entrypoint, "__qualname__", repr(plan.entrypoint))
    return f"{name}({', '.join(map(repr, args))}) (started with {plan.start_method})"


def _stream(io: RankIO, std: Std) -> str:
    """Where one stream of a rank goes."""
    path = io.stdout if std is Std.OUT else io.stderr
    if io.tee & std:
        return f"{path}, and the console with the prefix {io.prefix!r}"
    if io.relay & std:
        return f"{path}, and copied to the console as written"
    if path == DEVNULL:
        return f"{DEVNULL} (not on the console: --local-ranks-filter)"
    return path or "the console (inherited)"
