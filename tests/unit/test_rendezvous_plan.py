"""The dynamic rendezvous: its decisions with a fake clock, and real concurrent joins in memory."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaunch.core import rendezvous as plan
from relaunch.core.rendezvous import Final, Settings, Step, decide_join
from relaunch.rendezvous.api import RendezvousError, RendezvousInfo
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.store import MemoryStore

S = Settings(min_nodes=2, max_nodes=4, join_timeout=100, last_call_timeout=10)


def test_join_counter_packs_ticket_and_workers() -> None:
    total = plan.join_increment(8) + plan.join_increment(2) + plan.join_increment(3)
    assert plan.unpack_join(total) == (3, 13)
    assert plan.assign(3, 13, 3) == (2, 10)


@pytest.mark.parametrize(
    ("ticket", "joined", "final", "min_at", "now", "step", "extra"),
    [
        (2, 1, Final(2, 8, "h", 1), None, 0, Step.MEMBER, None),
        (3, 3, Final(2, 8, "h", 1), None, 0, Step.LATE, None),
        (5, 5, None, 0, 0, Step.LATE, None),  # beyond max_nodes
        (1, 4, None, 0, 0, Step.COMPLETE, 4),  # max reached: at once
        (1, 2, None, 5, 6, Step.WAIT, 15),  # min reached, last call runs to 15
        (1, 3, None, 5, 15, Step.COMPLETE, 3),  # last call over
        (2, 3, None, 5, 50, Step.WAIT, 100),  # not ticket 1: wait for the final record
        (1, 1, None, None, 100, Step.FAIL, "2 node(s) to join (1 joined)"),
        (2, 1, None, None, 100, Step.FAIL, "ticket 1 to complete the round"),
    ],
)
def test_join_decisions(
    ticket: int,
    joined: int,
    final: Final | None,
    min_at: float | None,
    now: float,
    step: Step,
    extra: object,
) -> None:
    decision = decide_join(S, ticket, joined, final, 0.0, min_at, now)
    assert decision.step is step
    if step is Step.COMPLETE:
        assert decision.count == extra
    if step is Step.WAIT:
        assert decision.deadline == extra
    if step is Step.FAIL:
        assert isinstance(extra, str) and extra in decision.reason


def test_a_round_after_a_running_one_waits_for_it_then_completes_at_the_expected_size() -> None:
    blocked = decide_join(S, 1, 3, None, 0.0, 0.0, 50.0, previous_running=True)
    assert blocked.step is Step.WAIT
    done = decide_join(S, 1, 3, None, 0.0, 0.0, 1.0, previous_running=False, expected=3)
    assert (done.step, done.count) == (Step.COMPLETE, 3)
    failed = decide_join(S, 1, 1, None, 0.0, None, 100.0, previous_running=True)
    assert failed.step is Step.FAIL and "make room" in failed.reason


def test_ring_and_liveness() -> None:
    assert plan.ring_neighbour(1, 1) is None
    assert [plan.ring_neighbour(t, 3) for t in (1, 2, 3)] == [2, 3, 1]
    fast = Settings(1, 1, keep_alive_interval=1, keep_alive_max_attempt=3)
    assert not plan.is_dead(10.0, 13.0, fast) and plan.is_dead(10.0, 13.1, fast)


@pytest.mark.parametrize(
    "bad",
    [
        {"min_nodes": 0},
        {"min_nodes": 3, "max_nodes": 2},
        {"join_timeout": 0},
        {"keep_alive_max_attempt": 0},
    ],
)
def test_settings_refuse_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        Settings(**{"min_nodes": 1, "max_nodes": 2, **bad})


def join_all(sizes: list[int], min_nodes: int, max_nodes: int) -> list[RendezvousInfo | str]:
    """Every node joins one in-memory store at once; each gets its info or its error."""
    store = MemoryStore()
    rules = Settings(
        min_nodes, max_nodes, join_timeout=1.0, last_call_timeout=0.05, keep_alive_interval=0.05
    )
    handlers = [
        DynamicRendezvousHandler("job", store, rules, size, "127.0.0.1", store) for size in sizes
    ]
    results: list[RendezvousInfo | str] = [""] * len(sizes)

    def join(index: int) -> None:
        try:
            results[index] = handlers[index].next_rendezvous()
        except RendezvousError as exc:
            results[index] = str(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(sizes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for handler in handlers:
        handler.shutdown()
    return results


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=10),
    bounds=st.tuples(st.integers(1, 6), st.integers(0, 4)),
)
def test_concurrent_joins_always_form_one_consistent_world(
    sizes: list[int], bounds: tuple[int, int]
) -> None:
    min_nodes = min(bounds[0], len(sizes))
    max_nodes = min_nodes + bounds[1]
    results = join_all(sizes, min_nodes, max_nodes)
    members = [(i, r) for i, r in enumerate(results) if isinstance(r, RendezvousInfo)]
    refused = [r for r in results if isinstance(r, str)]
    assert min_nodes <= len(members) <= max_nodes
    assert len(members) + len(refused) == len(sizes)  # no node holds two places
    assert sorted(info.group_rank for _, info in members) == list(range(len(members)))
    world = {info.world_size for _, info in members}
    assert world == {sum(sizes[i] for i, _ in members)}
    ranks = sorted(
        r for i, info in members for r in range(info.rank_offset, info.rank_offset + sizes[i])
    )
    assert ranks == list(range(world.pop()))  # a permutation of 0..world-1
    assert len({(info.master_addr, info.master_port) for _, info in members}) == 1
    assert {info.group_world_size for _, info in members} == {len(members)}
    # Latecomers wait for the running job to make room (or behind one that does).
    assert all("make room" in r or "ticket 1 to complete" in r for r in refused)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("min_nodes", "outcome"), [(1, "alone"), (2, "error")])
def test_a_node_that_dies_between_joining_and_registering_is_left_out(
    min_nodes: int, outcome: str
) -> None:
    store = MemoryStore()
    rules = Settings(min_nodes, 2, join_timeout=20, last_call_timeout=5, keep_alive_interval=0.1)
    handler = DynamicRendezvousHandler("half", store, rules, 1, "127.0.0.1", store)
    results: list[object] = []

    def join() -> None:
        try:
            results.append(handler.next_rendezvous())
        except RendezvousError as exc:
            results.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    store.wait(["relaunch/half/r0/node/1"], 10)
    store.add("relaunch/half/r0/joins", plan.join_increment(1))  # joins, then "dies"
    thread.join(20)
    handler.shutdown()
    (result,) = results
    if outcome == "alone":
        assert isinstance(result, RendezvousInfo)
        assert (result.group_world_size, result.world_size) == (1, 1)
    else:
        assert isinstance(result, RendezvousError) and "fewer than 2" in str(result)
