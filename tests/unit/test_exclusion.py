"""Excluding a node that keeps failing the job (core.exclusion), with ``now`` passed in; the
handler's record of it on an in-memory store; the health check's runner."""

from __future__ import annotations

import os
import time

import pytest
from conftest import pid_alive, wait_until

from relaunch.agent.health import HealthCheck, run_check
from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange, expected_size
from relaunch.core.run import exclusion
from relaunch.core.run.exclusion import ExclusionPolicy, NodeRecord, after_failure, excluded_until

POLICY = ExclusionPolicy(after=3, cooldown=100.0)


def test_the_third_failure_excludes_the_node_for_the_cooldown() -> None:
    record = NodeRecord()
    for now in (10.0, 20.0):
        record = after_failure(record, POLICY, now, others=2, min_nodes=1)
        assert excluded_until(record, now) is None
    record = after_failure(record, POLICY, 30.0, others=2, min_nodes=1)
    assert record == NodeRecord(failures=0, excluded_until=130.0, exclusions=1)
    assert excluded_until(record, 129.9) == 130.0
    assert excluded_until(record, 130.0) is None  # the cooldown is over: it may join again


def test_a_node_the_job_cannot_do_without_is_not_excluded() -> None:
    record = NodeRecord(failures=2)
    kept = after_failure(record, POLICY, 5.0, others=1, min_nodes=2)
    assert kept == NodeRecord(failures=3) and excluded_until(kept, 5.0) is None
    # Once a spare waits (one more node left without it), the next failure excludes it.
    out = after_failure(kept, POLICY, 6.0, others=2, min_nodes=2)
    assert excluded_until(out, 6.0) == 106.0


def test_after_zero_never_excludes() -> None:
    record = NodeRecord()
    for now in range(10):
        record = after_failure(record, ExclusionPolicy(after=0), float(now), 5, 1)
    assert record.failures == 10 and excluded_until(record, 9.0) is None


@pytest.mark.parametrize("raw", [None, b""])
def test_an_absent_record_is_clean(raw: bytes | None) -> None:
    assert exclusion.decode_record(raw) == NodeRecord()


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1]",
        b'{"failures": "x"}',
        b'{"failures": -1}',
        b'{"failures": 1.5}',
        b'{"exclusions": true}',
        b'{"excluded_until": "soon"}',
        b'{"excluded_until": NaN}',
        b'{"excluded_until": Infinity}',
    ],
)
def test_a_record_no_relaunch_wrote_is_refused(raw: bytes) -> None:
    """Read as clean, it would silently forget the node's failures or lift its exclusion."""
    with pytest.raises(ValueError):
        exclusion.decode_record(raw)


def test_a_bad_record_in_the_store_is_one_line_naming_its_key() -> None:
    from relaunch.core.rendezvous.rounds import Settings
    from relaunch.rendezvous.api import BadStoreValue
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.store import MemoryStore

    store = MemoryStore()
    rules = Settings(1, 2, join_timeout=10, last_call_timeout=0.05, keep_alive_interval=0.05)
    handler = DynamicRendezvousHandler.on_counters(
        "job",
        store,
        rules,
        "127.0.0.1",
        store,
        identity="h/a",
        exclusion_policy=ExclusionPolicy(),
    )
    try:
        store.set("relaunch/job/nodes/h/a", b'{"failures": "x"}')
        with pytest.raises(BadStoreValue) as caught:
            handler.job.prepare_join()
        message = str(caught.value)
        assert "relaunch/job/nodes/h/a" in message and "failures is not a count" in message
        assert "\n" not in message
    finally:
        handler.shutdown()


def test_a_record_round_trips() -> None:
    record = NodeRecord(2, 1234.5, 3)
    assert exclusion.decode_record(exclusion.encode_record(record)) == record


@pytest.mark.parametrize("bad", [{"after": -1}, {"cooldown": 0.0}, {"cooldown": float("nan")}])
def test_the_policy_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ExclusionPolicy(**bad)  # type: ignore[arg-type]


def test_node_identity_and_names() -> None:
    assert exclusion.node_identity("host1", None) == "host1"
    assert exclusion.node_identity("host1", "gpu0-3") == "host1/gpu0-3"
    assert exclusion.valid_node_name("a.b_c-1")
    for bad in ("", "a/b", "a b", "x" * 65, "é"):
        assert not exclusion.valid_node_name(bad)


def test_an_excluded_member_shrinks_the_next_round() -> None:
    change = MembershipChange.member_excluded(1, "node h excluded")
    assert change.kind is ChangeKind.MEMBER_EXCLUDED and change.member == 1
    assert expected_size(3, change, waiting=1) == 3  # the spare takes its place


# -- the handler's record of this node, on a real (in-memory) store ------------------------------


def test_the_failing_node_that_re_forms_the_round_is_recorded_and_then_excluded() -> None:
    from relaunch.core.rendezvous.rounds import Settings
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.store import MemoryStore

    store = MemoryStore()
    rules = Settings(1, 2, join_timeout=10, last_call_timeout=0.05, keep_alive_interval=0.05)
    policy = ExclusionPolicy(after=2, cooldown=60.0)
    handler = DynamicRendezvousHandler.on_counters(
        "job", store, rules, "127.0.0.1", store, identity="h/a", exclusion_policy=policy
    )
    try:
        assert handler.job.prepare_join() is None
        handler.next_rendezvous()
        handler.job.note_restart("h: rank 0 exited with 1")
        assert handler.job.prepare_join() is None  # one failure: counted, not excluded
        assert exclusion.decode_record(store.get("relaunch/job/nodes/h/a").value).failures == 1
        handler.next_rendezvous()
        handler.job.note_restart("h: rank 0 exited with 1")
        # Alone, the job cannot go on without it: counted, never excluded.
        assert handler.job.prepare_join() is None
        assert exclusion.decode_record(store.get("relaunch/job/nodes/h/a").value).failures == 2
        assert handler.job.prepare_join() is None  # leaving twice counts once
        assert exclusion.decode_record(store.get("relaunch/job/nodes/h/a").value).failures == 2
    finally:
        handler.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("evicted", [1, 0])
def test_an_eviction_excludes_the_agent_evicted_not_the_other_of_its_host(evicted: int) -> None:
    """Two agents of one host share an identity (no ``node_name``): the judge's eviction of
    one (the other, or itself) re-forms the round, which both see at once; the one evicted is
    out for the cooldown, saying why, and the other is not excluded (before: both were, the
    other "having failed the job too often", and the job waited for a node it lacked)."""
    import threading

    from relaunch.core.rendezvous.rounds import Settings
    from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
    from relaunch.store import MemoryStore

    store = MemoryStore()
    rules = Settings(1, 2, join_timeout=10, last_call_timeout=0.05, keep_alive_interval=0.05)
    policy = ExclusionPolicy(after=3, cooldown=60.0)
    handlers = [
        DynamicRendezvousHandler.on_counters(
            "job",
            store,
            rules,
            "127.0.0.1",
            store,
            watch_store=store,
            identity="h",
            exclusion_policy=policy,
        )
        for _ in range(2)
    ]
    try:
        ranks: dict[DynamicRendezvousHandler, int] = {}

        def join(handler: DynamicRendezvousHandler) -> None:
            ranks[handler] = handler.next_rendezvous().rank

        joins = [threading.Thread(target=join, args=(handler,)) for handler in handlers]
        for thread in joins:
            thread.start()
        for thread in joins:
            thread.join(20)
        judge = next(handler for handler in handlers if ranks[handler] == 0)
        slow, fast = sorted(handlers, key=lambda handler: ranks[handler] != evicted)
        line = f"node h (node {evicted}) evicted as a straggler (...) for 3 s"
        began = time.time()
        judge.job.evict(evicted, line)
        for handler in handlers:
            change = handler.job.wait_membership_change(10)
            assert change is not None and change.kind is ChangeKind.MEMBER_EVICTED
            assert (change.member, change.detected_by, change.reason) == (evicted, 0, line)
        until = slow.job.prepare_join()
        assert until is not None and began + 59 < until < time.time() + 61
        assert (slow.job.exclusion_reason, slow.job.evicted) == ("evicted as a straggler", line)
        assert fast.job.prepare_join() is None and fast.job.evicted is None
        assert store.get("relaunch/job/nodes/h").value is None  # the host's record untouched
    finally:
        for handler in handlers:
            handler.shutdown()


# -- the health check -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_passing_check_is_healthy_and_sees_the_environment_given() -> None:
    result = run_check(
        HealthCheck('test "$LOCAL_WORLD_SIZE" = 4'), {**os.environ, "LOCAL_WORLD_SIZE": "4"}
    )
    assert result.healthy and result.status == "exit 0"


@pytest.mark.timeout(30)
def test_a_failing_check_says_its_status_and_last_line() -> None:
    result = run_check(HealthCheck("echo first; echo 'gpu 3: ECC errors' >&2; exit 3"), os.environ)
    assert not result.healthy
    assert (result.status, result.last_line) == ("exit 3", "gpu 3: ECC errors")


@pytest.mark.timeout(30)
def test_a_check_past_its_timeout_is_killed_with_what_it_started(tmp_path) -> None:
    pid_file = tmp_path / "pid"
    command = f"sleep 300 & echo $! > {pid_file}; echo started; wait"
    started = time.monotonic()
    result = run_check(HealthCheck(command, timeout=0.5), os.environ)
    assert time.monotonic() - started < 10
    assert not result.healthy and result.status == "timed out after 0.5s"
    assert result.last_line == "started"
    sleeper = int(pid_file.read_text())
    wait_until(lambda: not pid_alive(sleeper), 5.0, "the check's own child to be killed")


@pytest.mark.timeout(30)
def test_a_check_killed_by_a_signal_says_so() -> None:
    result = run_check(HealthCheck("kill -9 $$"), os.environ)
    assert not result.healthy and result.status == "killed by SIGKILL"
