"""The agent's pure decisions: the lost-node grace, and how worker output is laid out."""

from __future__ import annotations

from relaunch.core.output.console_plan import agent_tee, console_is_relaunchs, log_line_prefixes
from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.core.run.group import GroupStatus
from relaunch.core.run.restart import Action, decide
from relaunch.core.workers.streams import Std


def test_a_failure_without_restarts_waits_for_a_lost_node_until_the_grace_ends() -> None:
    first = decide(GroupStatus.FAILED, 0, None, lost_node_grace=5.0, now=100.0)
    assert (first.action, first.deadline, first.uses_restart) == (Action.AWAIT_CHANGE, 105.0, False)
    later = decide(GroupStatus.FAILED, 0, None, lost_node_grace=5.0, now=103.0, grace_ends=105.0)
    assert (later.action, later.deadline) == (Action.AWAIT_CHANGE, 105.0)
    over = decide(GroupStatus.FAILED, 0, None, lost_node_grace=5.0, now=105.0, grace_ends=105.0)
    assert (over.action, over.deadline) == (Action.FAIL, None)


def test_a_change_during_the_grace_restarts_for_free() -> None:
    lost = MembershipChange.member_lost(1, "no heartbeat", detected_by=0)
    decision = decide(GroupStatus.FAILED, 0, lost, lost_node_grace=5.0, now=101.0)
    assert (decision.action, decision.uses_restart, decision.reason) == (
        Action.RESTART,
        False,
        "node of group rank 1 lost (no heartbeat)",
    )


def test_no_grace_is_given_while_restarts_remain_or_without_one() -> None:
    assert decide(GroupStatus.FAILED, 1, None, lost_node_grace=5.0).action is Action.RESTART
    assert decide(GroupStatus.FAILED, 0, None, lost_node_grace=0.0, now=7.0).action is Action.FAIL
    assert decide(GroupStatus.RUNNING, 0, None, lost_node_grace=5.0).deadline is None


def test_hang_detection_tees_the_streams_left_on_the_console() -> None:
    assert agent_tee(Std.OUT, Std.NONE, 2, hang_detection=False) == Std.OUT
    assert agent_tee(Std.OUT, {1: Std.ERR}, 2, hang_detection=True) == {0: Std.ALL, 1: Std.OUT}


def test_relaunch_draws_on_the_console_only_when_no_worker_writes_to_it() -> None:
    assert console_is_relaunchs(Std.ALL, Std.NONE, 2)
    assert console_is_relaunchs({0: Std.OUT, 1: Std.ALL}, {0: Std.ERR}, 2)
    assert not console_is_relaunchs(Std.OUT, Std.NONE, 2)
    assert not console_is_relaunchs({0: Std.ALL}, Std.NONE, 2)


def test_line_prefixes_follow_torchruns_template() -> None:
    assert log_line_prefixes(None, "trainer", [(0, 4)]) == {}
    assert log_line_prefixes("", "trainer", [(0, 4)]) == {}
    template = "[${role_name} ${rank}/${local_rank}] "
    assert log_line_prefixes(template, "trainer", [(0, 4), (1, 5)]) == {
        0: "[trainer 4/0] ",
        1: "[trainer 5/1] ",
    }


def test_hang_detection_counts_silence_on_its_clock() -> None:
    from relaunch.agent.expiry import ExpiryWatch
    from relaunch.core.run.run_events import NodeSnapshot, RankSample
    from relaunch.core.workers.progress import Progress
    from relaunch.runtime import ManualClock

    clock = ManualClock()
    watch = ExpiryWatch("run", timers=False, hang_timeout=10.0, clock=clock)
    progress: dict[int, Progress | None] = {0: None}

    def snapshot() -> NodeSnapshot:
        return NodeSnapshot(clock.time(), {0: RankSample(progress[0])})

    watch.watch({0: 4_000_000}, {0: []}, snapshot)  # no such pid: never signalled
    assert watch.check() == 10.0
    clock.advance(4.0)
    assert watch.check() == 6.0
    progress[0] = Progress(1, None, clock.time(), "", 1)  # a sign of life restarts the count
    clock.advance(3.0)
    assert watch.check() == 7.0


def test_a_silent_rank_has_every_running_ranks_stack_taken_and_names_the_hang() -> None:
    """``--hang-timeout``: the silent rank and the others still running are asked for their
    stacks (SIGABRT), as for an overdue section, so the culprit can be judged from all of them."""
    import signal
    import subprocess

    from relaunch.agent.expiry import ExpiryWatch
    from relaunch.core.run.run_events import NodeSnapshot, RankSample
    from relaunch.core.workers.progress import Progress
    from relaunch.runtime import ManualClock

    clock = ManualClock()
    watch = ExpiryWatch("run", timers=False, hang_timeout=10.0, clock=clock)
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:

        def snapshot() -> NodeSnapshot:  # rank 1 reports progress all along: never silent
            busy = Progress(1, None, clock.time(), "", 1)
            return NodeSnapshot(clock.time(), {0: RankSample(None), 1: RankSample(busy)})

        watch.watch({rank: proc.pid for rank, proc in enumerate(ranks)}, {0: [], 1: []}, snapshot)
        clock.advance(10.0)
        watch.check()
        assert watch.hang is not None and watch.hang.startswith("local rank 0 is hung")
        assert watch.stacks_taken
        assert [proc.wait(timeout=10) for proc in ranks] == [-signal.SIGABRT, -signal.SIGABRT]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
