"""Rank assignment and the worker environment, exactly as torchrun gives them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from relaunch.core.value import Value

#: The role of a ``WorkerSpec`` that names none, and of a node whose agent did not say.
DEFAULT_ROLE = "default"


class WorkerRanks(Value):
    """Where one worker stands in the job."""

    __slots__ = ("global_rank", "local_rank", "role_rank", "role_world_size", "world_size")

    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int

    def __init__(
        self,
        local_rank: int,
        global_rank: int,
        role_rank: int,
        world_size: int,
        role_world_size: int,
    ) -> None:
        self._set(
            local_rank=local_rank,
            global_rank=global_rank,
            role_rank=role_rank,
            world_size=world_size,
            role_world_size=role_world_size,
        )


class NodePlace(NamedTuple):
    """Where a node's workers stand in the job: the global rank of its first worker and the
    number of workers of all nodes, and the same counted within the node's role only."""

    rank_offset: int
    world_size: int
    role_rank_offset: int
    role_world_size: int


#: Consecutive nodes (by group rank) of one role with the same number of workers:
#: ``(role, nodes, workers per node)``. A role of None is a node whose role is not known (it
#: joined and died before saying it): it counts towards no role's ranks.
RoleRun = tuple["str | None", int, int]


def one_role_place(rank_offset: int, world_size: int) -> NodePlace:
    """The place of a node in a job of a single role: role ranks are global ranks."""
    return NodePlace(rank_offset, world_size, rank_offset, world_size)


def ranks_of(place: NodePlace, local_world_size: int) -> list[WorkerRanks]:
    """The ranks of the ``local_world_size`` workers of a node at ``place``; ValueError when
    they do not fit the world sizes it gives."""
    for first, world, what in (
        (place.rank_offset, place.world_size, "a world"),
        (place.role_rank_offset, place.role_world_size, "a role world"),
    ):
        if local_world_size < 1 or not 0 <= first <= world - local_world_size:
            raise ValueError(
                f"{local_world_size} workers from rank {first} do not fit {what} of {world}"
            )
    return [
        WorkerRanks(
            local,
            place.rank_offset + local,
            place.role_rank_offset + local,
            place.world_size,
            place.role_world_size,
        )
        for local in range(local_world_size)
    ]


def ranks_at_offset(rank_offset: int, local_world_size: int, world_size: int) -> list[WorkerRanks]:
    """The ranks of a node whose first worker has global rank ``rank_offset``, in a job of a
    single role."""
    return ranks_of(one_role_place(rank_offset, world_size), local_world_size)


def role_runs(nodes: Iterable[tuple[str | None, int]]) -> tuple[RoleRun, ...]:
    """``(role, workers)`` of each node in group-rank order, as runs (``RoleRun``): one run a
    stretch of nodes alike, so a job of few roles is said in few runs whatever its size."""
    runs: list[RoleRun] = []
    for role, workers in nodes:
        if runs and runs[-1][0] == role and runs[-1][2] == workers:
            runs[-1] = (role, runs[-1][1] + 1, workers)
        else:
            runs.append((role, 1, workers))
    return tuple(runs)


def role_place(
    runs: Sequence[RoleRun], group_rank: int, role: str | None = None
) -> tuple[int, int]:
    """``(role rank of its first worker, workers of its role)`` of the node of ``group_rank``
    among the nodes ``runs`` describe: a role's nodes hold its ranks in group-rank order, as
    torch 2.13's agent assigns them. ValueError when the runs give that node no role, or
    another than ``role``."""
    nodes = sum(count for _, count, _ in runs)
    if not 0 <= group_rank < nodes:
        raise ValueError(f"group rank {group_rank} is outside 0..{nodes - 1}")
    seen, mine = 0, None
    for run_role, count, _ in runs:
        if seen <= group_rank < seen + count:
            mine = run_role
            break
        seen += count
    if mine is None or (role is not None and mine != role):
        raise ValueError(
            f"the rendezvous gives the node of group rank {group_rank} the role {mine!r}, "
            f"not {role!r}"
        )
    seen = offset = size = 0
    for run_role, count, workers in runs:
        if run_role == mine:
            size += count * workers
            offset += min(max(group_rank - seen, 0), count) * workers
        seen += count
    return offset, size


def place_in_runs(runs: Sequence[RoleRun], group_rank: int) -> NodePlace:
    """The place of the node of ``group_rank`` among the nodes ``runs`` describe, every node's
    role and workers known: global ranks are contiguous per node in group-rank order, role
    ranks the same within each role (``role_place``)."""
    role_offset, role_world = role_place(runs, group_rank)
    seen = offset = world = 0
    for _, count, workers in runs:
        offset += min(max(group_rank - seen, 0), count) * workers
        world += count * workers
        seen += count
    return NodePlace(offset, world, role_offset, role_world)


def places(nodes: Sequence[tuple[str, int]]) -> list[NodePlace]:
    """The place of every node, given ``(role, workers)`` of each in group-rank order (what a
    node that gathered them all hands out): ``place_in_runs`` for each, in one pass."""
    role_sizes: dict[str, int] = {}
    for role, workers in nodes:
        role_sizes[role] = role_sizes.get(role, 0) + workers
    world = sum(role_sizes.values())
    offset, role_offsets, out = 0, dict.fromkeys(role_sizes, 0), []
    for role, workers in nodes:
        out.append(NodePlace(offset, world, role_offsets[role], role_sizes[role]))
        offset += workers
        role_offsets[role] += workers
    return out


def assign_ranks(
    local_world_sizes: Sequence[int], group_rank: int, roles: Sequence[str] | None = None
) -> list[WorkerRanks]:
    """The ranks of the workers of node ``group_rank``.

    ``local_world_sizes[g]`` is the number of workers on the node of group rank ``g``, and
    ``roles[g]`` its role (None: one role for all); nodes may differ in both. Global ranks are
    contiguous per node and ordered by group rank; role ranks likewise within each role.
    """
    if not 0 <= group_rank < len(local_world_sizes):
        raise ValueError(f"group rank {group_rank} is outside 0..{len(local_world_sizes) - 1}")
    if any(size < 1 for size in local_world_sizes):
        raise ValueError(f"every node needs at least one worker: {list(local_world_sizes)}")
    if roles is None:
        roles = [""] * len(local_world_sizes)
    if len(roles) != len(local_world_sizes):
        raise ValueError(f"{len(roles)} roles for {len(local_world_sizes)} nodes")
    runs = role_runs(zip(roles, local_world_sizes, strict=True))
    return ranks_of(place_in_runs(runs, group_rank), local_world_sizes[group_rank])


class GroupContext(Value):
    """What every worker of this node's group shares, known once the rendezvous completed."""

    __slots__ = (
        "group_rank",
        "group_world_size",
        "local_world_size",
        "master_addr",
        "master_port",
        "max_restarts",
        "restart_count",
        "role",
        "run_id",
        "use_agent_store",
    )

    role: str
    run_id: str
    group_rank: int
    group_world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    use_agent_store: bool

    def __init__(
        self,
        role: str,
        run_id: str,
        group_rank: int,
        group_world_size: int,
        local_world_size: int,
        master_addr: str,
        master_port: int,
        restart_count: int,
        max_restarts: int,
        use_agent_store: bool = False,
    ) -> None:
        self._set(
            role=role,
            run_id=run_id,
            group_rank=group_rank,
            group_world_size=group_world_size,
            local_world_size=local_world_size,
            master_addr=master_addr,
            master_port=master_port,
            restart_count=restart_count,
            max_restarts=max_restarts,
            use_agent_store=use_agent_store,
        )


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
