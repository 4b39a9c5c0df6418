"""The job's restart count and the presence check, with real handlers on one in-memory store (each
handler's round watcher is a real thread blocked on the round's signal)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from relaunch.core.rendezvous.membership import ChangeKind
from relaunch.core.rendezvous.rounds import Settings
from relaunch.rendezvous.dynamic import DynamicRendezvousHandler
from relaunch.rendezvous.kinds_counter import CounterKind
from relaunch.rendezvous.presence import presence_check
from relaunch.rendezvous.roster import CounterRoster
from relaunch.rendezvous.rounds import Rounds
from relaunch.store import MemoryStore

pytestmark = pytest.mark.timeout(30)

#: Changes travel by the round's signal here. Under load a last call of 0.05 s can close the
#: first round with two (the third then waits), and heartbeats of 0.05 s can judge a starved
#: member lost: either is a free re-form that would stand in for a restart a test counts. So
#: the first round waits for all three, and nobody is judged within a test; later rounds form
#: as soon as their expected members are in.
RULES = Settings(2, 3, join_timeout=10.0, last_call_timeout=5.0, keep_alive_interval=1.0)


def all_at_once(handlers: list[DynamicRendezvousHandler], step: Callable[[int], object]) -> list:
    """``step(i)`` for every handler at once, each in its own thread; their results."""
    results: list = [None] * len(handlers)

    def run(index: int) -> None:
        results[index] = step(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return results


@pytest.fixture
def job() -> Iterator[list[DynamicRendezvousHandler]]:
    """Three nodes of one job, in their first round."""
    store = MemoryStore()
    handlers = [
        DynamicRendezvousHandler.on_counters(
            "job", store, RULES, "127.0.0.1", store, watch_store=store
        )
        for _ in range(3)
    ]
    all_at_once(handlers, lambda i: handlers[i].next_rendezvous())
    yield handlers
    for handler in handlers:
        handler.shutdown()


def test_every_member_answers_a_presence_check_that_many_askers_share(job) -> None:
    assert all_at_once(job[:2], lambda i: job[i].job.peers_alive(1.0)) == [True, True]
    assert job[2].job.peers_alive(1.0) is True  # the outcome stands for the round
    assert all(handler.job.membership_change() is None for handler in job)  # nobody re-forms


def test_a_member_that_does_not_answer_makes_the_presence_check_false() -> None:
    store = MemoryStore()
    key = Rounds("job", CounterKind(store), RULES, "127.0.0.1", "n").key
    roster = CounterRoster(store, key)
    roster.mark("here", 0)
    roster.mark("here", 0)
    assert presence_check(store, roster, key, 0, 3, 0.2) is False
    for _ in range(3):
        roster.mark("here", 1)
    assert presence_check(store, roster, key, 1, 3, 0.2) is True


def test_two_nodes_failing_at_once_spend_one_restart_and_a_re_form_spends_none(job) -> None:
    assert [handler.job.restarts_used(0) for handler in job] == [0, 0, 0]
    job[0].job.note_restart("node 0: rank 0 failed")
    job[1].job.note_restart("node 1: rank 1 failed")

    def rejoin(i: int) -> object:
        if i == 2:  # node 2 failed nothing: like an agent, it re-forms once told of the change
            assert job[2].job.wait_membership_change(5.0) is not None
        return job[i].next_rendezvous()

    all_at_once(job, rejoin)
    assert [handler.job.restarts_used(0) for handler in job] == [1, 1, 1]
    job[2].shutdown()  # a member leaves: the others re-form without it, for free
    for handler in job[:2]:
        change = handler.job.wait_membership_change(5.0)
        assert change is not None and change.kind is ChangeKind.MEMBER_LEFT
    all_at_once(job[:2], lambda i: job[i].next_rendezvous())
    assert [handler.job.restarts_used(5) for handler in job[:2]] == [1, 1]


def test_a_failed_job_stops_the_other_members_through_the_round_signal(job) -> None:
    job[0].job.fail_job("node 0: rank 0 exited with code 1 (no restart left)")
    for handler in job[1:]:
        change = handler.job.wait_membership_change(5.0)
        assert change is not None and change.kind is ChangeKind.FAILED
        assert (
            change.reason == "the job failed: node 0: rank 0 exited with code 1 (no restart left)"
        )
    assert job[1].is_closed()


def test_the_failure_that_closed_the_job_outlives_a_change_that_came_first(job) -> None:
    """A round re-formed by one node's restart keeps that change (the first wins), so a
    crash loop's stop decided just after it is told only by the job's ``closed`` record: a
    node that was re-forming reads from it why the job ended, and that it must not requeue."""
    job[1].job.note_restart("node 1: rank 1 failed")
    job[1].job.leave_round()  # the round re-forms for node 1's restart
    job[0].job.fail_job("node 0: the same failure 3 times in a row", requeue=False)
    assert job[2].is_closed()
    change = job[2].job.wait_membership_change(5.0)
    assert change is not None and change.kind is ChangeKind.RESTARTING  # not the failure
    failure = job[2].job.closing_failure()
    assert failure is not None and failure.kind is ChangeKind.FAILED and not failure.requeue
    assert failure.reason == "the job failed: node 0: the same failure 3 times in a row"


def test_a_job_closed_without_a_failure_tells_none(job) -> None:
    job[0].set_closed()
    assert job[1].is_closed() and job[1].job.closing_failure() is None
