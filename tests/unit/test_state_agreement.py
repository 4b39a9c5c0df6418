"""The step the nodes agree on (``core.workers.state_agreement.agreement``), from their state
records alone: a table of records and what every node reads from them."""

from __future__ import annotations

import pytest

from relaunch.core.workers.state_agreement import Agreement, NodeState, agreement, node_held

A, B, C = "10.0.0.1:4000", "10.0.0.2:4000", "10.0.0.3:4000"


def node(
    address: str | None,
    held: dict[int, list[int]],
    runs: list[int],
    replicated: list[int] | None = None,
) -> NodeState:
    return NodeState(address, held, replicated or [], runs)


CASES = {
    "each node its own ranks, no copies: the newest common step": (
        {0: node(None, {0: [3, 5]}, [0]), 1: node(None, {1: [5, 7]}, [1])},
        2,
        Agreement(5, {0: [3, 5], 1: [5, 7]}, {}, []),
    ),
    "no step common to every rank: afresh": (
        {0: node(None, {0: [3]}, [0]), 1: node(None, {1: [5]}, [1])},
        2,
        Agreement(None, {0: [3], 1: [5]}, {}, []),
    ),
    "a rank no node holds: afresh": (
        {0: node(None, {0: [3]}, [0]), 1: node(None, {}, [1])},
        2,
        Agreement(None, {0: [3]}, {}, []),
    ),
    "ranks moved between nodes that copy state: pulled from their holders": (
        {0: node(A, {0: [5]}, [1]), 1: node(B, {1: [5]}, [0])},
        2,
        Agreement(5, {0: [5], 1: [5]}, {(0, 5): A, (1, 5): B}, []),
    ),
    "ranks moved between nodes without copies: nothing reaches them": (
        {0: node(None, {0: [5]}, [1]), 1: node(None, {1: [5]}, [0])},
        2,
        Agreement(None, {}, {}, []),
    ),
    "the holder copies, the rank's new node does not: not reached": (
        {0: node(A, {0: [5], 1: [5]}, [1]), 1: node(None, {}, [0])},
        2,
        Agreement(None, {1: [5]}, {(1, 5): A}, []),
    ),
    "a replicated save serves every rank": (
        {0: node(None, {0: [4]}, [0, 1], replicated=[4])},
        2,
        Agreement(4, {0: [4], 1: [4]}, {}, []),
    ),
    "a rank no node runs: any node that copies reaches it": (
        {0: node(A, {0: [2], 2: [2]}, [0]), 1: node(B, {1: [2]}, [1])},
        3,
        Agreement(2, {0: [2], 1: [2], 2: [2]}, {(0, 2): A, (2, 2): A, (1, 2): B}, []),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_step_agreed(name: str) -> None:
    nodes, world_size, expected = CASES[name]
    got = agreement(nodes, world_size, 0, len(nodes), replicas=0)
    assert got.step == expected.step
    assert got.held == expected.held
    assert got.holders == expected.holders
    assert got.successors == expected.successors


@pytest.mark.parametrize(
    ("group_rank", "replicas", "members", "successors"),
    [
        (0, 1, {0: A, 1: B, 2: C}, [B]),
        (2, 1, {0: A, 1: B, 2: C}, [A]),  # ring order
        (0, 2, {0: A, 1: B, 2: C}, [B, C]),
        (0, 5, {0: A, 1: B, 2: C}, [B, C]),  # never itself
        (0, 2, {0: A, 1: None, 2: C}, [C]),  # a node that copies nothing takes no copy
        (0, 2, {0: A, 2: C}, [C]),  # a member whose record could not be read
    ],
)
def test_the_successors_are_the_next_nodes_that_copy(
    group_rank: int, replicas: int, members: dict[int, str | None], successors: list[str]
) -> None:
    nodes = {member: node(address, {}, [member]) for member, address in members.items()}
    got = agreement(nodes, 3, group_rank, 3, replicas)
    assert got.successors == successors


def test_a_record_reads_back_as_posted() -> None:
    mine = NodeState(A, {3: [7, 8]}, [8], [3])
    assert node_held(mine.encode()) == mine
    alone = NodeState(None, {}, [], [0, 1])
    assert node_held(alone.encode()) == alone
