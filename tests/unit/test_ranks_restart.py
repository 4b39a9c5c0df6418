from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relaunch.core.rendezvous.membership import (
    MembershipChange,
    decode_change,
    encode_change,
    expected_size,
)
from relaunch.core.run.group import GroupStatus
from relaunch.core.run.restart import Action, decide
from relaunch.core.workers.ranks import GroupContext, WorkerRanks, assign_ranks, worker_env


def test_ranks_are_contiguous_per_node_in_group_rank_order() -> None:
    sizes = [2, 3, 1]
    assert [w.global_rank for w in assign_ranks(sizes, 0)] == [0, 1]
    assert [w.global_rank for w in assign_ranks(sizes, 1)] == [2, 3, 4]
    assert assign_ranks(sizes, 2) == [WorkerRanks(0, 5, 5, 6, 6)]


@given(st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=16))
def test_all_nodes_together_hold_each_rank_once(sizes: list[int]) -> None:
    ranks = [w.global_rank for g in range(len(sizes)) for w in assign_ranks(sizes, g)]
    assert ranks == list(range(sum(sizes)))


@pytest.mark.parametrize(("sizes", "group_rank"), [([2], 1), ([2], -1), ([2, 0], 0)])
def test_bad_rank_assignment_inputs(sizes: list[int], group_rank: int) -> None:
    with pytest.raises(ValueError):
        assign_ranks(sizes, group_rank)


GROUP_FIELDS = {
    "role": "trainer",
    "run_id": "job7",
    "group_rank": 1,
    "group_world_size": 2,
    "local_world_size": 2,
    "master_addr": "10.0.0.1",
    "master_port": 29500,
    "restart_count": 3,
    "max_restarts": 5,
}
GROUP = GroupContext(**GROUP_FIELDS)


def test_worker_env_is_torchruns() -> None:
    ranks = assign_ranks([2, 2], 1)[1]
    assert worker_env(ranks, GROUP, {}) == {
        "LOCAL_RANK": "1",
        "RANK": "3",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "OMP_NUM_THREADS": "1",
    }


def test_worker_env_respects_the_users_settings() -> None:
    ranks = assign_ranks([2, 2], 1)[0]
    inherited = {
        "OMP_NUM_THREADS": "8",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1",
    }
    env = worker_env(ranks, GROUP, inherited)
    assert "OMP_NUM_THREADS" not in env  # inherited as the user set it
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
    single = GroupContext(**{**GROUP_FIELDS, "local_world_size": 1})
    assert "OMP_NUM_THREADS" not in worker_env(assign_ranks([1], 0)[0], single, {})


@pytest.mark.parametrize(
    ("state", "left", "change", "action", "uses"),
    [
        (GroupStatus.SUCCEEDED, 0, None, Action.SUCCEED, False),
        (GroupStatus.SUCCEEDED, 3, MembershipChange.nodes_waiting(1), Action.SUCCEED, False),
        (GroupStatus.FAILED, 1, None, Action.RESTART, True),
        (GroupStatus.FAILED, 0, None, Action.FAIL, False),
        (GroupStatus.FAILED, 0, MembershipChange.member_lost(2, "gone", 1), Action.RESTART, False),
        (GroupStatus.RUNNING, 0, None, Action.CONTINUE, False),
        (GroupStatus.RUNNING, 0, MembershipChange.nodes_waiting(1), Action.RESTART, False),
        # Another node's failure with no restart left ends this node too, running or failed.
        (GroupStatus.RUNNING, 2, MembershipChange.failed("n1: rank 3 failed"), Action.FAIL, False),
        (GroupStatus.FAILED, 2, MembershipChange.failed("n1: rank 3 failed"), Action.FAIL, False),
        (GroupStatus.RUNNING, 2, MembershipChange.finished(), Action.FAIL, False),
    ],
)
def test_restart_policy(
    state: GroupStatus, left: int, change: MembershipChange | None, action: Action, uses: bool
) -> None:
    decision = decide(state, left, change)
    assert (decision.action, decision.uses_restart) == (action, uses)


def test_with_no_restart_left_a_failure_is_final_at_once_when_every_peer_answers() -> None:
    alive = decide(GroupStatus.FAILED, 0, None, lost_node_grace=20.0, now=5.0, peers_alive=True)
    assert (alive.action, alive.deadline) == (Action.FAIL, None)
    for unknown in (False, None):  # one may be dead: wait for its loss to be noticed
        waiting = decide(
            GroupStatus.FAILED, 0, None, lost_node_grace=20.0, now=5.0, peers_alive=unknown
        )
        assert (waiting.action, waiting.deadline) == (Action.AWAIT_CHANGE, 25.0)
    lost = MembershipChange.member_lost(1, "gone", 0)
    assert decide(GroupStatus.FAILED, 0, lost, peers_alive=True).action is Action.RESTART
    assert decide(GroupStatus.FAILED, 1, None, peers_alive=True).uses_restart


def test_the_failed_change_says_why_and_never_shrinks_the_next_round() -> None:
    change = MembershipChange.failed("n1: rank 3 exited with code 1")
    assert decode_change(encode_change(change, 4)) == (change, 4)
    assert expected_size(4, change) == 4
    assert decide(GroupStatus.RUNNING, 0, change).reason == (
        "the job failed: n1: rank 3 exited with code 1"
    )
