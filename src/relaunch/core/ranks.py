"""Rank assignment and the worker environment, exactly as torchrun gives them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerRanks:
    """Where one worker stands in the job."""

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int


def ranks_at_offset(rank_offset: int, local_world_size: int, world_size: int) -> list[WorkerRanks]:
    """The ranks of a node whose first worker has global rank ``rank_offset``."""
    if local_world_size < 1 or not 0 <= rank_offset <= world_size - local_world_size:
        raise ValueError(
            f"{local_world_size} workers from rank {rank_offset} do not fit a world of {world_size}"
        )
    return [
        WorkerRanks(local, rank_offset + local, rank_offset + local, world_size, world_size)
        for local in range(local_world_size)
    ]


def assign_ranks(local_world_sizes: Sequence[int], group_rank: int) -> list[WorkerRanks]:
    """The ranks of the workers of node ``group_rank``.

    ``local_world_sizes[g]`` is the number of workers on the node of group rank ``g``; nodes may
    differ. Global ranks are contiguous per node and ordered by group rank. With a single role,
    role ranks equal global ranks.
    """
    if not 0 <= group_rank < len(local_world_sizes):
        raise ValueError(f"group rank {group_rank} is outside 0..{len(local_world_sizes) - 1}")
    if any(size < 1 for size in local_world_sizes):
        raise ValueError(f"every node needs at least one worker: {list(local_world_sizes)}")
    return ranks_at_offset(
        sum(local_world_sizes[:group_rank]), local_world_sizes[group_rank], sum(local_world_sizes)
    )


@dataclass(frozen=True)
class GroupContext:
    """What every worker of this node's group shares, known once the rendezvous completed."""

    role: str
    run_id: str
    group_rank: int
    group_world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    use_agent_store: bool = False


#: Variables passed through from the launcher's environment, with torchrun's defaults.
#: ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is ``--signals-to-handle``: ``launch_agent`` puts it in
#: the launcher's environment, as torchrun 2.13's does, for the workers to inherit.
PASS_THROUGH_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
}


def omp_num_threads_default(local_world_size: int, inherited: Mapping[str, str]) -> str | None:
    """``"1"`` when several workers share the node and the user set no OMP_NUM_THREADS."""
    if local_world_size > 1 and "OMP_NUM_THREADS" not in inherited:
        return "1"
    return None


def worker_env(
    ranks: WorkerRanks, group: GroupContext, inherited: Mapping[str, str]
) -> dict[str, str]:
    """The variables one worker gets on top of the launcher's environment ``inherited``."""
    env = {
        "LOCAL_RANK": str(ranks.local_rank),
        "RANK": str(ranks.global_rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(ranks.role_rank),
        "ROLE_NAME": group.role,
        "LOCAL_WORLD_SIZE": str(group.local_world_size),
        "WORLD_SIZE": str(ranks.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(ranks.role_world_size),
        "MASTER_ADDR": group.master_addr,
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(group.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(group.max_restarts),
        "TORCHELASTIC_RUN_ID": group.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(group.use_agent_store),
    }
    for name, default in PASS_THROUGH_DEFAULTS.items():
        env[name] = inherited.get(name, default)
    omp = omp_num_threads_default(group.local_world_size, inherited)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env
