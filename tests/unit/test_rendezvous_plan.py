"""The dynamic rendezvous: its decisions with a fake clock, and real concurrent joins in memory."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaunch.core.rendezvous import node_order
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import (
    ChangeKind,
    MembershipChange,
    decode_change,
    encode_change,
    expected_size,
)
from relaunch.core.rendezvous.rounds import Final, Settings, Step, decide_join
from relaunch.rendezvous.api import RendezvousError, RendezvousInfo
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.store import MemoryStore
from relaunch.store.api import StoreConnectionError, Versioned

S = Settings(min_nodes=2, max_nodes=4, join_timeout=100, last_call_timeout=10)


def test_join_counter_packs_ticket_and_workers() -> None:
    total = sum(plan.join_increment(size, "default") for size in (8, 2, 3))
    assert plan.unpack_join(total)[:2] == (3, 13)
    assert node_order.assign(None, 3, 13, 3) == (2, 10)


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
        (2, 1, None, None, 100, Step.FAIL, "the first node to complete the round"),
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
    # A spare waits past join_timeout for as long as the round before runs, for any ticket.
    for ticket in (1, 2):
        spare = decide_join(S, ticket, 1, None, 0.0, None, 100.0, previous_running=True)
        assert (spare.step, spare.deadline) == (Step.WAIT, 200.0)
    failed = decide_join(S, 1, 1, None, 0.0, None, 100.0, previous_running=False)
    assert failed.step is Step.FAIL and "2 node(s) to join" in failed.reason


def test_ring_and_liveness() -> None:
    assert plan.ring_neighbour(0, 1) is None
    assert [plan.ring_neighbour(rank, 3) for rank in (0, 1, 2)] == [1, 2, 0]
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
        DynamicRendezvousHandler.on_counters("job", store, rules, "127.0.0.1", store) for _ in sizes
    ]
    for handler, size in zip(handlers, sizes, strict=True):
        handler.job.set_workers("default", size)
    results: list[RendezvousInfo | str] = [""] * len(sizes)

    def join(index: int) -> None:
        try:
            results[index] = handlers[index].next_rendezvous()
        except RendezvousError as exc:
            results[index] = str(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(sizes))]
    for thread in threads:
        thread.start()
    # Nodes beyond the first round wait as spares while it runs: once its members have their
    # places, the job finishes, and the spares are dismissed.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        final = store.get("relaunch/job/news/r0/final").value
        placed = sum(isinstance(r, RendezvousInfo) for r in results)
        if final is not None and placed >= json.loads(final)["count"]:
            break
        time.sleep(0.01)
    member = next(
        (h for h, r in zip(handlers, results, strict=True) if isinstance(r, RendezvousInfo)), None
    )
    if member is not None:
        member.set_closed()
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
    world = {info.global_world_size for _, info in members}
    assert world == {sum(sizes[i] for i, _ in members)}
    offsets = [(i, info.rank_offset or 0) for i, info in members]
    ranks = sorted(r for i, offset in offsets for r in range(offset, offset + sizes[i]))
    assert ranks == list(range(world.pop() or 0))  # a permutation of 0..world-1
    assert len({(info.master_addr, info.master_port) for _, info in members}) == 1
    assert {info.group_world_size for _, info in members} == {len(members)}
    # Latecomers wait as spares until the job finishes (or behind one that does).
    assert all("already finished" in r or "first node to complete" in r for r in refused)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("min_nodes", "outcome"), [(1, "alone"), (2, "error")])
def test_a_node_that_dies_between_joining_and_registering_is_left_out(
    min_nodes: int, outcome: str
) -> None:
    store = MemoryStore()
    rules = Settings(min_nodes, 2, join_timeout=20, last_call_timeout=5, keep_alive_interval=0.1)
    handler = DynamicRendezvousHandler.on_counters("half", store, rules, "127.0.0.1", store)
    results: list[object] = []

    def join() -> None:
        try:
            results.append(handler.next_rendezvous())
        except RendezvousError as exc:
            results.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    store.wait(["relaunch/half/r0/node/1"], 10)
    store.add("relaunch/half/r0/joins", plan.join_increment(1, "default"))  # joins, "dies"
    thread.join(20)
    handler.shutdown()
    (result,) = results
    if outcome == "alone":
        assert isinstance(result, RendezvousInfo)
        assert (result.group_world_size, result.global_world_size) == (1, 1)
    else:
        assert isinstance(result, RendezvousError) and "fewer than 2" in str(result)


@pytest.mark.parametrize(
    ("change", "members", "waiting", "expected"),
    [
        (MembershipChange.nodes_waiting(2), 3, 2, 5),
        (MembershipChange.member_lost(1, "no heartbeat for 3s", 0), 3, 0, 2),
        (MembershipChange.member_lost(1, "its etcd lease expired", 2), 3, 1, 3),
        (MembershipChange.member_left(0), 3, 0, 2),
        (MembershipChange.restarting(), 3, 0, 3),
        (MembershipChange.restarting("h1: rank 0 failed: NCCL peer lost"), 3, 1, 4),
        (MembershipChange.finished(), 3, 0, 3),
        (MembershipChange.store_lost("connection lost"), 3, 0, 3),
        (MembershipChange.store_lost("timed out"), 1, 2, 3),
    ],
)
def test_expected_size_follows_the_kind_not_the_words(
    change: MembershipChange, members: int, waiting: int, expected: int
) -> None:
    assert expected_size(members, change, waiting) == expected


@pytest.mark.parametrize("kind", list(ChangeKind))
def test_a_changed_record_carries_the_kind(kind: ChangeKind) -> None:
    change = MembershipChange(kind, f"{kind.value}: lost", member=2, detected_by=1)
    assert decode_change(encode_change(change, 7)) == (change, 7)
    assert json.loads(encode_change(change, 7))["kind"] == kind.value


def test_a_failed_record_says_whether_the_job_may_be_requeued() -> None:
    final = MembershipChange.failed("n1: no progress", requeue=False)
    assert decode_change(encode_change(final, 2))[0] == final and not final.requeue
    assert "requeue" not in json.loads(encode_change(MembershipChange.failed("x"), 2))
    assert decode_change(b'{"kind": "failed", "reason": "x"}')[0].requeue


def test_a_changed_record_without_a_kind_never_shrinks_the_next_round() -> None:
    change, expected = decode_change(b'{"reason": "node of group rank 1 lost", "expected": 2}')
    assert (change.kind, change.reason, expected) == (
        ChangeKind.RESTARTING,
        "node of group rank 1 lost",
        2,
    )
    assert expected_size(3, change) == 3


def _rules(min_nodes: int, max_nodes: int) -> Settings:
    """Fast beats; a silent node counts as lost after 1s, so one that stops beating to join
    the next round is not taken for lost before its ``changed`` record arrives."""
    return Settings(
        min_nodes,
        max_nodes,
        join_timeout=10,
        last_call_timeout=5,
        keep_alive_interval=0.05,
        keep_alive_max_attempt=20,
    )


class _UnreachableWatch(MemoryStore):
    """A watch connection that breaks at once: its node sees "lost the rendezvous store"."""

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        raise StoreConnectionError("connection lost")


def _rejoin(handler: DynamicRendezvousHandler) -> tuple[threading.Thread, list[object]]:
    """Start ``handler.next_rendezvous()`` in a thread; the list gets its info or error."""
    results: list[object] = []

    def join() -> None:
        try:
            results.append(handler.next_rendezvous())
        except RendezvousError as exc:
            results.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    return thread, results


def _form(handlers: list[DynamicRendezvousHandler]) -> list[RendezvousInfo]:
    """Every handler joins at once; their infos, in order."""
    joins = [_rejoin(handler) for handler in handlers]
    for thread, _ in joins:
        thread.join(20)
    infos = [result for _, results in joins for result in results]
    assert len(infos) == len(handlers) and all(isinstance(i, RendezvousInfo) for i in infos)
    return [info for info in infos if isinstance(info, RendezvousInfo)]


def _changed(store: MemoryStore, run_id: str, round_: int) -> dict[str, object]:
    value = store.get(f"relaunch/{run_id}/news/r{round_}/changed").value
    assert value is not None
    record: dict[str, object] = json.loads(value)
    return record


@pytest.mark.timeout(60)
@pytest.mark.parametrize("min_nodes", [1, 2])
def test_losing_the_store_is_not_losing_a_member(min_nodes: int) -> None:
    """A node whose watch connection broke re-forms the round for all its members: the next
    round expects every one of them (the reason says "lost", but no member was)."""
    store = MemoryStore()
    rules = _rules(min_nodes, 2)
    cut_off = DynamicRendezvousHandler.on_counters(
        "store", store, rules, "127.0.0.1", store, watch_store=_UnreachableWatch()
    )
    other = DynamicRendezvousHandler.on_counters(
        "store", store, rules, "127.0.0.1", store, watch_store=store
    )
    handlers = [cut_off, other]
    try:
        _form(handlers)
        change = cut_off.job.wait_membership_change(10)
        assert change is not None and change.kind is ChangeKind.STORE_LOST
        assert other.job.membership_change() is None
        thread, results = _rejoin(cut_off)  # it re-forms round 0, then waits in round 1
        seen = other.job.wait_membership_change(10)
        assert seen is not None and seen.kind is ChangeKind.STORE_LOST
        assert "lost the rendezvous store" in seen.reason
        record = _changed(store, "store", 0)
        assert (record["kind"], record["expected"]) == ("store_lost", 2)
        again = other.next_rendezvous()
        thread.join(20)
        assert again.group_world_size == 2
        assert [r.group_world_size for r in results if isinstance(r, RendezvousInfo)] == [2]
    finally:
        for handler in handlers:
            handler.shutdown()


@pytest.mark.timeout(60)
def test_a_forwarded_worker_error_saying_lost_restarts_the_round_at_full_size() -> None:
    store = MemoryStore()
    rules = _rules(1, 2)
    failed, other = (
        DynamicRendezvousHandler.on_counters(
            "fwd", store, rules, "127.0.0.1", store, watch_store=store
        )
        for _ in range(2)
    )
    handlers = [failed, other]
    notified = threading.Event()
    other.job.set_change_listener(lambda change: notified.set())
    try:
        _form(handlers)
        failed.job.note_restart("h1: rank 0 failed: connection to peer lost")
        thread, results = _rejoin(failed)
        assert notified.wait(10), "the listener hears of the change"
        seen = other.job.membership_change()
        assert seen is not None and seen.kind is ChangeKind.RESTARTING
        assert seen.reason == "h1: rank 0 failed: connection to peer lost"
        assert _changed(store, "fwd", 0)["expected"] == 2
        # What this node read forwards the restart: it must not count a member lost either.
        assert expected_size(2, seen) == 2
        other.job.set_change_listener(None)
        again = other.next_rendezvous()
        thread.join(20)
        assert again.group_world_size == 2
        assert [r.group_world_size for r in results if isinstance(r, RendezvousInfo)] == [2]
    finally:
        for handler in handlers:
            handler.shutdown()


@pytest.mark.timeout(60)
def test_a_lost_member_shrinks_the_next_round_and_says_who_noticed() -> None:
    store = MemoryStore()
    rules = _rules(1, 3)
    handlers = [
        DynamicRendezvousHandler.on_counters(
            "lost", store, rules, "127.0.0.1", store, watch_store=store
        )
        for _ in range(3)
    ]
    try:
        infos = _form(handlers)
        rank = {info.group_rank: handler for info, handler in zip(infos, handlers, strict=True)}
        rank[
            1
        ]._membership.stop_watching()  # its heartbeat stops: it "dies" (its neighbour is rank 0)
        change = rank[0].job.wait_membership_change(10)
        assert change is not None and change.kind is ChangeKind.MEMBER_LOST
        assert (change.member, change.detected_by) == (1, 0)
        assert change.reason.startswith("node of group rank 1 lost (no heartbeat for")
        thread, results = _rejoin(rank[0])
        seen = rank[2].job.wait_membership_change(10)
        assert seen == change  # the record carries the kind and who noticed
        assert _changed(store, "lost", 0)["expected"] == 2
        again = rank[2].next_rendezvous()
        thread.join(20)
        assert again.group_world_size == 2
        assert [r.group_world_size for r in results if isinstance(r, RendezvousInfo)] == [2]
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_listener_set_after_the_change_is_called_at_once() -> None:
    store = MemoryStore()
    rules = _rules(1, 1)
    handler = DynamicRendezvousHandler.on_counters(
        "late", store, rules, "127.0.0.1", store, watch_store=_UnreachableWatch()
    )
    try:
        handler.next_rendezvous()
        assert handler.job.wait_membership_change(10) is not None
        calls: list[int] = []
        handler.job.set_change_listener(lambda change: calls.append(1))
        assert calls == [1]
    finally:
        handler.shutdown()
