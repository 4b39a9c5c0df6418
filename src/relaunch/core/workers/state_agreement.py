"""Which step a world of several nodes resumes from: each node posts what it holds (a
``NodeState`` record), and every node merges the same records into the same step
(``agreement``). The agent's side, the posting and the copies, is ``agent.state``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import NamedTuple

from relaunch.core.workers.state import common_step, successors


class NodeState(NamedTuple):
    """A node's state record: its state server's address (None: it copies no state), the
    steps it holds by rank, those of its replicated saves, and the global ranks it runs in the
    new world."""

    address: str | None
    held: dict[int, list[int]]
    replicated: list[int]
    runs: list[int]

    def reaches(self, rank: int, runner: NodeState | None) -> bool:
        """Whether ``rank``, run by ``runner`` (None: not known), can resume from what this
        node holds: a rank of its own, or one whose node can pull it from this one (both
        copy state: the job has a token)."""
        if rank in self.runs:
            return True
        return self.address is not None and (runner is None or runner.address is not None)

    def encode(self) -> bytes:
        """The record as the node posts it (``node_held`` reads it)."""
        record = {
            "address": self.address,
            "held": self.held,
            "replicated": self.replicated,
            "runs": self.runs,
        }
        return json.dumps(record).encode()


def _whole_numbers(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def node_held(raw: bytes) -> NodeState:
    """A node's state record, read; ``ValueError`` saying what is wrong when it is not one."""
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError("not an object")
    address, held = record.get("address"), record.get("held")
    if not (address is None or isinstance(address, str)) or not isinstance(held, dict):
        raise ValueError("address and held are not a string (or null) and an object")
    steps: dict[int, list[int]] = {}
    for rank, kept in held.items():
        if not rank.isdigit() or not isinstance(kept, list):
            raise ValueError(f"held[{rank!r}] is not a rank's list of steps")
        if not _whole_numbers(kept):
            raise ValueError(f"held[{rank!r}] holds a step that is not a whole number")
        steps[int(rank)] = kept
    replicated, runs = record.get("replicated", []), record.get("runs", [])
    if not _whole_numbers(replicated) or not _whole_numbers(runs):
        raise ValueError("replicated and runs are not lists of whole numbers")
    return NodeState(address, steps, replicated, runs)


class Agreement(NamedTuple):
    """What the nodes' records come to: the ``step`` the world resumes from (None: afresh),
    the steps held for each rank on any node it can resume from (``held``), a node's address
    that holds each ``(rank, step)`` (``holders``), and the addresses of the nodes this one
    copies its state to (``successors``)."""

    step: int | None
    held: dict[int, list[int]]
    holders: dict[tuple[int, int], str]
    successors: list[str]


def agreement(
    nodes: Mapping[int, NodeState],
    world_size: int,
    group_rank: int,
    group_world_size: int,
    replicas: int,
) -> Agreement:
    """Merge the records of the round's ``nodes`` (by group rank) for a world of
    ``world_size`` ranks, as seen by the node of ``group_rank``. Any rank may resume from a
    replicated save; without copies (no token), a node holds steps for its own ranks alone.
    Every node reads the same records: the same step."""
    anywhere: dict[int, set[int]] = {}
    holders: dict[tuple[int, int], str] = {}
    runners = {rank: node for node in nodes.values() for rank in node.runs}
    for node in nodes.values():
        for rank in range(world_size):
            steps = node.held.get(rank, []) + node.replicated
            if steps and node.reaches(rank, runners.get(rank)):
                anywhere.setdefault(rank, set()).update(steps)
                for kept in steps:
                    if node.address is not None:
                        holders.setdefault((rank, kept), node.address)
    addresses = [
        address
        for member in successors(group_rank, group_world_size, replicas)
        if member in nodes and (address := nodes[member].address) is not None
    ]
    held = {rank: sorted(steps) for rank, steps in anywhere.items()}
    return Agreement(common_step(anywhere, world_size), held, holders, addresses)
