"""What every attempt of the agent's worker group runs (``Command``), and what the workers of
the group just joined share (``GroupContext``), for ``core.workers.attempt``'s plan."""

from __future__ import annotations

from relaunch.agent.spec import WorkerGroup, WorkerSpec
from relaunch.core.workers.attempt import Command
from relaunch.core.workers.ranks import GroupContext
from relaunch.procs.logs_specs import LogsSpecs, OwnPlan


def command_of(
    spec: WorkerSpec, logs: OwnPlan | LogsSpecs, start_method: str, prefix_template: str | None
) -> Command:
    """What every attempt of ``spec`` runs, and how its output goes (``logs``)."""
    assert spec.entrypoint is not None
    own = logs if isinstance(logs, OwnPlan) else None
    return Command(
        spec.role,
        spec.entrypoint,
        spec.args,
        spec.local_world_size,
        own.redirects if own else spec.redirects,
        own.tee if own else spec.tee,
        start_method,
        spec.shutdown_timeout,
        own.local_ranks_filter if own else None,
        prefix_template,
        None if own else logs,
        tuple(spec.duplicate_stdout_filters or ()),
        tuple(spec.duplicate_stderr_filters or ()),
    )


def group_context(group: WorkerGroup, restart_count: int, agent_store: bool) -> GroupContext:
    """What every worker of the group just joined shares (``agent_store``: torch's store
    is served by an agent, not by worker rank 0)."""
    spec = group.spec
    assert group.group_rank is not None and group.group_world_size is not None
    assert group.master_addr is not None and group.master_port is not None
    return GroupContext(
        role=spec.role,
        run_id=spec.rdzv_handler.get_run_id(),
        group_rank=group.group_rank,
        group_world_size=group.group_world_size,
        local_world_size=spec.local_world_size,
        master_addr=group.master_addr,
        master_port=group.master_port,
        restart_count=restart_count,
        max_restarts=spec.max_restarts,
        use_agent_store=agent_store,
    )
