"""Where this node's workers stand, from what its rendezvous handler returned.

relaunch's handlers say it (``RendezvousInfo.rank_offset`` and the rest, from the round's
records): nothing is left to do. A handler written for torch returns only the node's rank, the
number of nodes and a store; then, as torch 2.13's agent does, each node publishes its role and
number of workers in that store, the node of group rank 0 places every node
(``core.workers.ranks.places``) and publishes the places, and each node reads its own: one exchange,
under torch's keys and in torch's format, so relaunch's and torch's agents can share a job.
Without a store (relaunch's static handler), or with ``TORCH_ELASTIC_WORKER_IDENTICAL=1``,
every node is taken to run as many workers as this one, of one role.
"""

from __future__ import annotations

import json
import os
from typing import Any

from relaunch.core.workers.ranks import NodePlace, one_role_place, places
from relaunch.rendezvous.any_store import AnyStore
from relaunch.rendezvous.api import RendezvousError
from relaunch.store.api import StoreError

#: torch's keys: a node's role and workers, and the place assigned to it, by group rank.
ROLE_INFO_PREFIX = "torchelastic/role_info/"
ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"


def node_place(info: Any, role: str, local_world_size: int) -> NodePlace:
    """Where the first of this node's ``local_world_size`` workers of ``role`` stands, given
    the ``info`` its handler returned (relaunch's ``RendezvousInfo`` or torch's)."""
    offset = getattr(info, "rank_offset", None)
    if offset is not None:
        world = info.global_world_size
        role_offset = getattr(info, "role_rank_offset", None)
        if role_offset is None:
            return one_role_place(offset, world)
        return NodePlace(offset, world, role_offset, info.role_world_size)
    group_rank, nodes = info.rank, info.world_size
    if info.store is None or os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        return one_role_place(group_rank * local_world_size, nodes * local_world_size)
    try:
        return gathered_place(AnyStore(info.store), group_rank, nodes, role, local_world_size)
    except StoreError as exc:
        raise RendezvousError(f"assigning the workers' ranks: {exc}") from None


def gathered_place(
    store: AnyStore, group_rank: int, nodes: int, role: str, local_world_size: int
) -> NodePlace:
    """This node's place, agreed through ``store`` with the other ``nodes - 1`` nodes."""
    mine = {"role": role, "rank": group_rank, "local_world_size": local_world_size}
    store.set_many([(f"{ROLE_INFO_PREFIX}{group_rank}", json.dumps(mine).encode())])
    if group_rank == 0:
        keys = [f"{ROLE_INFO_PREFIX}{rank}" for rank in range(nodes)]
        every = [_role_info(key, raw) for key, raw in zip(keys, store.get_many(keys), strict=True)]
        store.set_many(
            (f"{ASSIGNED_RANKS_PREFIX}{rank}", json.dumps(list(place)).encode())
            for rank, place in enumerate(places(every))
        )
    key = f"{ASSIGNED_RANKS_PREFIX}{group_rank}"
    (raw,) = store.get_many([key])
    try:
        values = json.loads(raw)
        if not (isinstance(values, list) and len(values) == 4):
            raise ValueError("expected four numbers")
        place = NodePlace(*(int(value) for value in values))
    except (ValueError, TypeError) as exc:
        raise _bad_value(key, exc) from None
    return place


def _role_info(key: str, raw: bytes) -> tuple[str, int]:
    """A node's ``(role, workers)`` as published under ``key``."""
    try:
        data = json.loads(raw)
        role, workers = data["role"], data["local_world_size"]
        if not isinstance(role, str) or not isinstance(workers, int) or workers < 1:
            raise ValueError("expected a role and a number of workers >= 1")
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad_value(key, exc) from None
    return role, workers


def _bad_value(key: str, why: Exception) -> RendezvousError:
    return RendezvousError(
        f"the rendezvous store holds a bad value under {key} ({why}): another job, or an agent "
        "of another kind, shares the handler's store"
    )
