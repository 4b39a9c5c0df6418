"""The agent's decisions as histories: observations in (each at a given time), actions out.

No agent, process, store or clock: ``core.run.step`` is fed what the agent would have observed, and
every action it asks for is compared with what the agent did before it was a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.core.run.restart import Backoff
from relaunch.core.run.run_events import AttemptEnded, Hung, NodeSnapshot, RankSample, Restarted
from relaunch.core.run.step import Rules, RunRecord, step
from relaunch.core.run.step_types import (
    Action,
    Announce,
    Began,
    CheckHangs,
    CheckPresence,
    CheckStore,
    Ended,
    EndedElsewhere,
    Fail,
    FailJob,
    HangsChecked,
    JobClosed,
    LeaveRound,
    LogLine,
    NotAgreed,
    NoteRestart,
    Observation,
    Observed,
    PeersAnswered,
    Placed,
    Rendezvous,
    ReportFailure,
    StacksPending,
    StartWorkers,
    StopForStacks,
    StopNote,
    StopWorkers,
    Succeed,
    TakeStacks,
    Wait,
    WorkersStarted,
)
from relaunch.core.workers.liveness import Liveness
from relaunch.core.workers.progress import Progress

CUT = "this node's workers were stopped before they finished"
BOOM = "rank 1 exited with code 3: ValueError: boom"


@dataclass
class Failed:
    """A failed worker as a report reads it (``core.run.failures.Failure``)."""

    local_rank: int = 1
    pid: int = 1_000_001
    exitcode: int = 3
    error_file: str = ""
    details: str = "ValueError: boom"
    timestamp: float = 1.0
    failed_at: float = 1.0


def progress(step: int) -> Progress:
    return Progress(step, None, 0.0, "", 1)


def said_by(
    steps: tuple[Progress | None, ...] = (None, None),
    lives: tuple[Liveness | None, ...] = (None, None),
) -> NodeSnapshot:
    """Two local ranks that said ``steps`` and ``lives`` in the channel."""
    ranks = {
        rank: RankSample(step, live)
        for rank, (step, live) in enumerate(zip(steps, lives, strict=True))
    }
    return NodeSnapshot(0.0, ranks)


def failed(steps: tuple[Progress | None, ...] = (None, None)) -> Ended:
    """Local rank 1 (global rank 1) failed; ``steps``: what the ranks reported."""
    return Ended({1: Failed()}, {0: 0, 1: 1}, said_by(steps))


SUCCEEDED = Ended({}, {0: 0, 1: 1})


def ended(state: str, restarts_left: int) -> Announce:
    return Announce(AttemptEnded("trainer", state, restarts_left))


def restarted(cause: str, reason: str, why: str, count: int, left: int) -> Announce:
    return Announce(Restarted("trainer", cause, reason, why, count, left))


def told(actions: list[Action]) -> list[object]:
    """The run events among ``actions``."""
    return [action.run_event for action in actions if isinstance(action, Announce)]


def rules(**values: object) -> Rules:
    base = Rules(role="trainer", node="n1", max_restarts=3, backoff=Backoff(0.0, 0.0))
    return base._replace(**values)


def run(
    state: RunRecord, history: list[tuple[float, Observation]]
) -> tuple[RunRecord, list[list[Action]]]:
    """Feed ``history`` (time, observation); the state after, and the actions of each step."""
    said = []
    for now, observation in history:
        state, actions = step(state, observation, now)
        said.append(actions)
    return state, said


def started(rule: Rules, nodes: int = 1, used: int = 0, at: float = 0.0) -> RunRecord:
    """A run whose first attempt started at ``at``."""
    state, said = run(
        RunRecord(rule), [(at, Began()), (at, Placed(nodes, used)), (at, WorkersStarted())]
    )
    assert said == [[Rendezvous(0.0)], [StartWorkers()], []]
    return state


def test_a_group_that_runs_is_watched_then_succeeds() -> None:
    _, said = run(
        started(rules()),
        [
            (1.0, Observed()),
            (1.0, HangsChecked(None, None, None)),
            (9.0, Observed(SUCCEEDED)),
        ],
    )
    assert said == [
        [CheckHangs(None)],
        [Wait(None)],  # nothing to wake it but an event
        [ended("SUCCEEDED", 3), Succeed()],
    ]


def test_a_failure_uses_a_restart_and_tells_the_other_nodes_why() -> None:
    state, said = run(started(rules(max_restarts=2)), [(5.0, Observed(failed(), used=0))])
    assert said == [
        [
            ended("FAILED", 2),
            ReportFailure(),
            StopWorkers(park=True),
            CheckStore(),
            restarted("worker_failed", BOOM, "a worker failed", 0, 1),
            NoteRestart(f"n1: {BOOM}"),
            Rendezvous(0.0),
        ]
    ]
    assert state.spent == 1 and state.used == 0  # the job's count comes with the next join
    state, said = run(state, [(6.0, Placed(1, used=1)), (6.0, WorkersStarted())])
    assert said == [[StartWorkers()], []]
    assert state.restarts_left == 1


def test_the_budget_is_the_jobs_as_it_counts_it() -> None:
    state = started(rules(max_restarts=2), nodes=2)
    _, said = run(state, [(5.0, Observed(failed(), used=1))])  # another node spent one
    assert restarted("worker_failed", BOOM, "a worker failed", 1, 0) in said[0]


def test_a_failure_among_several_nodes_is_told_as_it_is_seen_not_once_its_group_stopped() -> None:
    """The monitor stops the failed rank's group; the others hear of it at once (they stop
    their workers meanwhile), and the restart, spent once, is not told a second time."""
    failing = Ended({1: Failed()}, {0: 0, 1: 1})
    state = started(rules(watches_membership=True, max_restarts=2), nodes=2)
    state, said = run(
        state,
        [
            (5.0, Observed(None, None, used=0, failing=failing)),
            (5.0, HangsChecked(None, None, None)),
            (5.1, Observed(None, None, used=1, failing=failing)),  # woken again meanwhile
            (5.1, HangsChecked(None, None, None)),
            (5.3, Observed(failed(), used=1)),  # the job's count has this node's restart
        ],
    )
    assert said[0] == [NoteRestart(f"n1: {BOOM}"), LeaveRound(), CheckHangs(None)]
    assert said[1:4] == [[Wait(None)], [CheckHangs(None)], [Wait(None)]]
    assert said[4] == [
        ended("FAILED", 2),
        ReportFailure(),
        StopWorkers(park=True),
        CheckStore(),
        restarted("worker_failed", BOOM, "a worker failed", 0, 1),
        Rendezvous(0.0),
    ]
    assert state.spent == 1 and state.used == 0
    state, said = run(state, [(6.0, Placed(2, used=1)), (6.0, WorkersStarted())])
    assert state.restarts_left == 1 and not state.left_early


@pytest.mark.parametrize(
    ("nodes", "max_restarts", "change"),
    [
        (1, 2, None),  # nobody to tell
        (2, 0, None),  # no restart left: a presence check decides, once the group stopped
        (2, 2, MembershipChange.member_lost(1, "no heartbeat", detected_by=0)),  # free, theirs
    ],
)
def test_a_failure_is_told_early_only_where_a_restart_of_its_own_follows_whatever_comes(
    nodes: int, max_restarts: int, change: MembershipChange | None
) -> None:
    failing = Ended({1: Failed()}, {0: 0, 1: 1})
    state = started(rules(watches_membership=True, max_restarts=max_restarts), nodes=nodes)
    _, said = run(state, [(5.0, Observed(None, change, used=0, failing=failing))])
    assert not any(isinstance(action, (LeaveRound, NoteRestart)) for action in said[0])


@pytest.mark.parametrize(
    ("change", "park"),
    [
        (MembershipChange.nodes_waiting(1), False),  # the workers run on: stopped
        (MembershipChange.member_lost(1, "no heartbeat", detected_by=0), True),
        (MembershipChange.restarting("n2: rank 3 exited with code 1"), True),
    ],
)
def test_ranks_may_park_only_where_a_restart_broke_the_groups_collectives(
    change: MembershipChange, park: bool
) -> None:
    """Ranks that restart in place wait for the next attempt when a peer died or stopped;
    nothing breaks a collective when nodes come (nor when a rank hangs: the test of a hang
    elsewhere below), so those ranks are stopped."""
    _, said = run(started(rules(watches_membership=True)), [(2.0, Observed(None, change))])
    assert said[0][1] == StopWorkers(park=park)


def test_a_membership_change_restarts_the_group_for_free() -> None:
    change = MembershipChange.nodes_waiting(1)
    state, said = run(started(rules(watches_membership=True)), [(2.0, Observed(None, change))])
    assert said == [
        [
            ended("RUNNING", 3),
            StopWorkers(),
            CheckStore(),
            restarted(
                "nodes_waiting", "1 node(s) waiting to join", "1 node(s) waiting to join", 0, 3
            ),
            Rendezvous(0.0),
        ]
    ]
    assert state.spent == 0


def test_nodes_that_cannot_agree_on_the_state_start_nothing_and_join_again_for_free() -> None:
    state = started(rules(watches_membership=True), nodes=2)
    reason = "the nodes could not agree on a step to resume from within 1m"
    state, said = run(
        state,
        [
            (2.0, Observed(failed(), used=0)),
            (3.0, Placed(2, 1)),
            (3.5, NotAgreed(reason)),
            (4.0, Placed(2, 1)),
        ],
    )
    assert said[1] == [StartWorkers()]
    assert said[2] == [
        LogLine(f"[trainer] {reason}: joining the rendezvous again"),
        CheckStore(),
        Rendezvous(0.0),
    ]
    assert said[3] == [StartWorkers()]
    assert state.spent == 1  # the failure's restart; the second join spent none


def test_a_failure_caused_by_a_lost_node_is_free_too() -> None:
    lost = MembershipChange.member_lost(1, "no heartbeat", detected_by=0)
    state = started(rules(watches_membership=True, max_restarts=0), nodes=2)
    state, said = run(state, [(2.0, Observed(failed(), lost, used=0))])
    assert said[0][:3] == [ended("FAILED", 0), ReportFailure(), StopWorkers(park=True)]
    assert told(said[0])[1] == Restarted("trainer", "member_lost", BOOM, lost.reason, 0, 0)
    assert state.spent == 0
    assert not any(isinstance(action, NoteRestart) for action in said[0])


def test_with_no_restart_left_a_failure_is_final_at_once_when_every_peer_answers() -> None:
    state = started(rules(watches_membership=True, max_restarts=0, lost_node_grace=60.0), nodes=2)
    _, said = run(state, [(3.0, Observed(failed(), used=0)), (3.5, PeersAnswered(True))])
    assert said == [
        [CheckPresence(1.0)],
        [
            ended("FAILED", 0),
            FailJob(f"n1: {BOOM} (no restart left)"),
            Fail(),
        ],
    ]


def test_with_a_peer_silent_the_grace_is_waited_and_then_the_failure_is_final() -> None:
    state = started(rules(watches_membership=True, max_restarts=0, lost_node_grace=5.0), nodes=2)
    state, said = run(
        state,
        [
            (10.0, Observed(failed(), used=0)),
            (10.0, PeersAnswered(False)),
            (10.0, HangsChecked(None, None, 15.0)),
            (12.0, Observed(failed(), used=0)),  # no second presence check, no second warning
            (12.0, HangsChecked(None, None, 15.0)),
            (15.0, Observed(failed(), used=0)),
        ],
    )
    assert said == [
        [CheckPresence(1.0)],
        [
            LogLine(
                "workers failed with no restart left, and not every other node answered: "
                "waiting up to 5s for a lost node to be noticed"
            ),
            CheckHangs(15.0),
        ],
        [Wait(15.0)],
        [CheckHangs(15.0)],
        [Wait(15.0)],
        [ended("FAILED", 0), FailJob(f"n1: {BOOM} (no restart left)"), Fail()],
    ]
    assert state.grace_ends is None


def test_a_node_lost_during_the_grace_re_forms_the_group_for_free() -> None:
    state = started(rules(watches_membership=True, max_restarts=0, lost_node_grace=5.0), nodes=2)
    lost = MembershipChange.member_lost(1, "no heartbeat for 3s", detected_by=0)
    state, said = run(
        state,
        [
            (10.0, Observed(failed(), used=0)),
            (10.0, PeersAnswered(None)),
            (12.0, Observed(failed(), lost, used=0)),
        ],
    )
    assert restarted("member_lost", BOOM, lost.reason, 0, 0) in said[2]
    assert said[2][-1] == Rendezvous(0.0)
    assert state.grace_ends is None and state.spent == 0
    state, said = run(state, [(13.0, Placed(1, 0)), (13.0, WorkersStarted())])
    assert state.peers_alive is None  # the presence check is this round's


def test_a_change_that_came_during_the_presence_check_is_taken() -> None:
    state = started(rules(watches_membership=True, max_restarts=0, lost_node_grace=5.0), nodes=2)
    lost = MembershipChange.member_lost(1, "no heartbeat", detected_by=0)
    _, said = run(state, [(1.0, Observed(failed(), used=0)), (1.5, PeersAnswered(False, lost))])
    assert restarted("member_lost", BOOM, lost.reason, 0, 0) in said[1]


@pytest.mark.parametrize(
    ("rule", "nodes"),
    [
        (rules(watches_membership=True, max_restarts=0, lost_node_grace=60.0), 1),  # alone
        (rules(max_restarts=0, lost_node_grace=60.0), 2),  # membership is not watched
    ],
)
def test_without_another_node_to_lose_a_failure_fails_at_once(rule: Rules, nodes: int) -> None:
    _, said = run(started(rule, nodes=nodes), [(1.0, Observed(failed(), used=0))])
    assert said == [[ended("FAILED", 0), FailJob(f"n1: {BOOM} (no restart left)"), Fail()]]


def test_a_failure_that_ended_the_job_elsewhere_cuts_this_node_short() -> None:
    change = MembershipChange.failed("n2: rank 3 exited with code 1")
    _, said = run(started(rules(watches_membership=True), nodes=2), [(1.0, Observed(None, change))])
    assert said == [
        [
            ended("RUNNING", 3),
            EndedElsewhere(f"the job failed: n2: rank 3 exited with code 1; {CUT}"),
        ]
    ]


def test_a_crash_loop_waits_its_backoff_and_stops_when_it_makes_no_progress() -> None:
    rule = rules(max_restarts=10, backoff=Backoff(1.0, 4.0, healthy=60.0), max_stalled=2)
    state = started(rule)
    said_all = []
    for attempt, reached in enumerate([5, 5, 3]):
        now = 10.0 * attempt + 2.0
        state, said = run(state, [(now, Observed(failed((progress(reached),) * 2), used=attempt))])
        said_all.append(said[0])
        if said[0][-1] != Fail():
            state, _ = run(state, [(now, Placed(1, attempt + 1)), (now, WorkersStarted())])
    first, second, third = said_all
    assert first[-1] == Rendezvous(0.0)  # no wait before the first restart of a loop
    assert second[-2:] == [
        LogLine(
            "[trainer] a crash loop: waiting 1s before restart 2 in a row (--restart-backoff 1:4)"
        ),
        Rendezvous(1.0),
    ]
    stalled = (
        "stopped after 2 restarts in a row that made no progress (the furthest step reached: 5):"
        " restarting again would repeat the same failure"
    )
    assert third == [
        ended("FAILED", 8),
        ReportFailure(),
        LogLine(f"[trainer] {stalled}", error=True),
        StopNote(f"{stalled}; do not requeue the job"),
        FailJob(f"n1: {BOOM} ({stalled})", requeue=False),
        Fail(requeue=False),
    ]


def test_workers_that_say_nothing_stop_once_they_fail_the_same_way_again_and_again() -> None:
    """No progress to judge by: the same failure (exception line and place) on the first
    attempt and ``max_stalled`` restarts in a row stops the job, not to be requeued."""
    rule = rules(max_restarts=10, backoff=Backoff(0.0, 0.0), max_stalled=2)
    state = started(rule)
    said_all = []
    for attempt in range(3):
        state, said = run(state, [(10.0 * attempt, Observed(failed(), used=attempt))])
        said_all.append(said[0])
        state, _ = run(state, [(10.0 * attempt, Placed(1, attempt + 1)), (0.0, WorkersStarted())])
    assert [said[-1] for said in said_all[:2]] == [Rendezvous(0.0), Rendezvous(0.0)]
    repeated = (
        "stopped after 3 attempts in a row failed the same way: restarting again would repeat it"
    )
    assert said_all[2][-3:] == [
        StopNote(f"{repeated}; do not requeue the job"),
        FailJob(f"n1: {BOOM} ({repeated})", requeue=False),
        Fail(requeue=False),
    ]


def test_a_failure_that_may_stop_a_crash_loop_is_not_told_before_its_group_stopped() -> None:
    """Among several nodes: the failures that may restart are told as they are seen; the one
    that could stop the job for good (the same failure again, ``max_stalled`` 2) waits for its
    group's end, and stops every node with "do not requeue", never re-forming them first."""
    rule = rules(max_restarts=10, watches_membership=True, max_stalled=2)
    state = started(rule, nodes=2)
    failing = Ended({1: Failed()}, {0: 0, 1: 1})
    early = []
    for attempt in range(3):
        now = 10.0 * attempt
        state, said = run(state, [(now, Observed(None, None, used=attempt, failing=failing))])
        early.append(LeaveRound() in said[0])
        state, said = run(state, [(now + 1, Observed(failed(), used=attempt + early[-1]))])
        if attempt < 2:
            assert said[0][-1] == Rendezvous(0.0)
            state, _ = run(state, [(now + 2, Placed(2, attempt + 1)), (now + 2, WorkersStarted())])
    assert early == [True, True, False]
    assert said[0][-1] == Fail(requeue=False)
    assert isinstance(said[0][-2], FailJob) and not said[0][-2].requeue


def test_a_job_stopped_elsewhere_for_good_cuts_this_node_short_for_good() -> None:
    change = MembershipChange.failed("n2: no progress", requeue=False)
    _, said = run(started(rules(watches_membership=True), nodes=2), [(1.0, Observed(None, change))])
    assert said[0][-1] == EndedElsewhere(f"the job failed: n2: no progress; {CUT}", requeue=False)


def test_a_group_that_ran_its_healthy_period_starts_a_new_loop() -> None:
    rule = rules(max_restarts=10, backoff=Backoff(1.0, 4.0, healthy=60.0))
    state = started(rule)
    state, _ = run(state, [(2.0, Observed(failed(), used=0)), (2.0, Placed(1, 1))])
    state, said = run(state, [(3.0, WorkersStarted()), (100.0, Observed(failed(), used=1))])
    assert said[1][-1] == Rendezvous(0.0) and state.crash_loop.in_a_row == 1


def test_a_worker_that_fails_before_it_speaks_fails_during_start_up() -> None:
    state = started(rules(max_restarts=5))
    spoke = failed((progress(1), progress(1)))  # the workers report progress
    state, said = run(state, [(4.0, Observed(spoke, used=0))])
    assert restarted("worker_failed", BOOM, "a worker failed", 0, 4) in said[0]
    state, _ = run(state, [(5.0, Placed(1, 1)), (5.0, WorkersStarted())])
    state, said = run(state, [(7.5, Observed(failed(), used=1))])  # rank 1 said nothing yet
    cause = f"during start-up (2.5s after it started): {BOOM}"
    assert restarted("worker_failed", cause, "a worker failed", 1, 3) in said[0]
    assert NoteRestart(f"n1: {cause}") in said[0]


def test_a_worker_that_heartbeats_has_spoken() -> None:
    beating = Liveness(1.0, 2.0, "", 0.0, 0.0, 0, 3, "", "given")
    state = started(rules(max_restarts=5))
    state, _ = run(state, [(4.0, Observed(failed((progress(1), None)), used=0))])
    state, _ = run(state, [(5.0, Placed(1, 1)), (5.0, WorkersStarted())])
    heartbeats = Ended({1: Failed()}, {0: 0, 1: 1}, said_by((None, None), (None, beating)))
    _, said = run(state, [(7.5, Observed(heartbeats, used=1))])
    assert restarted("worker_failed", BOOM, "a worker failed", 1, 3) in said[0]


def test_of_workers_that_never_speak_no_start_up_failure_is_told() -> None:
    _, said = run(started(rules()), [(0.5, Observed(failed(), used=0))])
    assert restarted("worker_failed", BOOM, "a worker failed", 0, 2) in said[0]


def test_a_hang_here_asks_the_other_nodes_for_their_stacks_once() -> None:
    hang = "local rank 0 is hung (section 'step' past its deadline)"
    state = started(rules(watches_membership=True), nodes=2)
    state, said = run(
        state,
        [
            (1.0, HangsChecked(hang, 0.5, None)),
            (1.5, HangsChecked(hang, 0.5, None)),
        ],
    )
    assert said == [
        [Announce(Hung(0, hang)), StopForStacks(f"n1: {hang}"), Wait(1.5)],
        [Wait(2.0)],  # hang detection's next look
    ]
    stacks = MembershipChange.restarting(f"n1: {hang}", stacks=True)
    state, said = run(state, [(3.0, Observed(failed(), stacks, used=0))])
    assert TakeStacks(f"n1: {hang}") not in said[0]  # its stacks were taken as it hung
    assert restarted("hang", BOOM, stacks.reason, 0, 3) in said[0]


def test_a_hang_with_no_restart_left_ends_the_job_with_stacks() -> None:
    hang = "local rank 0 is hung (heartbeat overdue)"
    state = started(rules(watches_membership=True, max_restarts=0), nodes=2)
    _, said = run(state, [(1.0, HangsChecked(hang, None, None))])
    assert said == [
        [
            Announce(Hung(0, hang)),
            FailJob(f"n1: {hang} (no restart left)", stacks=True),
            Wait(None),
        ]
    ]


def test_a_hang_alone_is_only_reported() -> None:
    hang = "local rank 0 is hung (heartbeat overdue)"
    _, said = run(started(rules(watches_membership=True)), [(1.0, HangsChecked(hang, 2.0, 9.0))])
    assert said == [[Announce(Hung(0, hang)), Wait(3.0)]]


def test_a_hang_on_another_node_takes_this_nodes_stacks_then_restarts() -> None:
    why = "n2: local rank 1 is hung (heartbeat overdue)"
    change = MembershipChange.restarting(why, stacks=True)
    state = started(rules(watches_membership=True), nodes=2)
    state, said = run(
        state,
        [
            (1.0, Observed(None, change)),
            (1.0, StacksPending(5.0)),
            (1.0, HangsChecked(None, 5.0, 6.0)),
            (2.0, Observed(failed(), change, used=1)),
        ],
    )
    assert said[:3] == [[TakeStacks(why)], [CheckHangs(6.0)], [Wait(6.0)]]
    assert said[3][:4] == [
        ended("FAILED", 2),
        ReportFailure(),
        StopWorkers(),
        CheckStore(),
    ]
    assert restarted("hang", BOOM, why, 1, 2) in said[3]
    assert not any(isinstance(action, NoteRestart) for action in said[3])  # the hung node's


def test_a_hang_elsewhere_that_ended_the_job_reports_where_this_nodes_ranks_were() -> None:
    change = MembershipChange.failed("n2: local rank 1 is hung (no restart left)", stacks=True)
    state = started(rules(watches_membership=True, max_restarts=0), nodes=2)
    _, said = run(state, [(1.0, Observed(None, change)), (3.0, Observed(failed(), change, used=0))])
    assert said == [
        [TakeStacks(change.reason)],
        [
            ended("FAILED", 0),
            ReportFailure(),
            EndedElsewhere(f"{change.reason}; {CUT}"),
        ],
    ]


def test_a_poll_of_membership_bounds_every_sleep() -> None:
    state = started(rules(watches_membership=True, polls_membership=True, monitor_interval=0.1))
    _, said = run(state, [(1.0, Observed()), (1.0, HangsChecked(None, None, None))])
    assert said == [[CheckHangs(None)], [Wait(1.1)]]


def test_the_job_closing_while_this_node_re_forms() -> None:
    change = MembershipChange.nodes_waiting(1)
    state = started(rules(watches_membership=True), nodes=2)
    reforming, _ = run(state, [(1.0, Observed(None, change))])
    _, said = run(reforming, [(2.0, JobClosed())])
    assert said == [
        [
            EndedElsewhere(
                f"the job ended while this node re-formed (1 node(s) waiting to join); {CUT}"
            )
        ]
    ]
    after_failure, _ = run(state, [(1.0, Observed(failed(), used=0))])
    _, said = run(after_failure, [(2.0, JobClosed())])
    assert said == [[Fail()]]  # the other nodes finished the job meanwhile: the failure stands


def test_the_job_failing_for_good_while_this_node_re_forms() -> None:
    """The closing node's failure, and its "do not requeue", are this node's end too."""
    state = started(rules(watches_membership=True), nodes=2)
    reforming, _ = run(state, [(1.0, Observed(None, MembershipChange.nodes_waiting(1)))])
    closed = JobClosed("the job failed: node 1: the same failure 3 times", requeue=False)
    _, said = run(reforming, [(2.0, closed)])
    why = "the job failed: node 1: the same failure 3 times"
    assert said == [
        [EndedElsewhere(f"the job ended while this node re-formed ({why}); {CUT}", requeue=False)]
    ]
    after_failure, _ = run(state, [(1.0, Observed(failed(), used=0))])
    _, said = run(after_failure, [(2.0, closed)])
    assert said == [[Fail(requeue=False)]]
