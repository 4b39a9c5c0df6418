"""The end-of-run summary's wording for workers that never started, restart reasons and
evictions."""

from __future__ import annotations

from relaunch.core.run.summary import RankEnd, RunSummary, format_summary


def test_workers_that_never_started_are_one_line() -> None:
    ranks = [RankEnd(-1, 0, None, 0.0), RankEnd(-1, 1, None, 0.0)]
    text = format_summary(RunSummary("ended by an error", 2.0, ranks, log_dir="/logs/run"))
    assert text.splitlines() == [
        "run summary: ended by an error in 2.0s",
        "  2 workers never started (local ranks 0, 1)",
        "  logs: /logs/run",
    ]
    one = format_summary(RunSummary("ended by an error", 2.0, [RankEnd(-1, 0, None, 0.0)]))
    assert one.splitlines()[1] == "  1 worker never started (local rank 0)"


def test_a_started_worker_that_did_not_end_is_still_said_so() -> None:
    text = format_summary(RunSummary("stopped by SIGTERM", 9.0, [RankEnd(3, 0, None, 8.0)]))
    assert text.splitlines()[1] == "  rank 3 (local 0): did not end after 8.0s"


def test_a_restart_reason_does_not_end_with_a_heading() -> None:
    reasons = [
        "rank 0 exited with code 3: last lines of stderr (/logs/attempt_0/0/stderr.log):",
        "rank 1 exited with code 1: Traceback (most recent call last):",
        "rank 0 exited with code 3: ValueError: boom",
        "membership changed",
    ]
    text = format_summary(RunSummary("failed", 1.0, restarts=reasons))
    assert text.splitlines()[1:] == [
        "  restart 1: rank 0 exited with code 3",
        "  restart 2: rank 1 exited with code 1",
        "  restart 3: rank 0 exited with code 3: ValueError: boom",
        "  restart 4: membership changed",
    ]


def test_a_hangs_verdict_has_its_line() -> None:
    said = "rank 2 did not reach the collective that ranks 0, 1, 3 wait in (all_reduce): ..."
    text = format_summary(RunSummary("failed", 2.0, hang=said, log_dir="/logs/run"))
    assert text.splitlines()[-2:] == [f"  hang: {said}", "  logs: /logs/run"]


def test_an_eviction_is_counted_apart_from_the_restarts() -> None:
    line = "node h/b (node 1, ranks 2-3) evicted as a straggler (...); a spare takes its place"
    text = format_summary(RunSummary("succeeded", 9.0, evictions=[line]))
    assert text.splitlines() == [
        "run summary: succeeded in 9.0s after 1 eviction",
        f"  eviction 1: {line} (no restart spent)",
    ]
    both = format_summary(RunSummary("succeeded", 9.0, restarts=["x", "y"], evictions=[line]))
    assert both.splitlines()[0] == "run summary: succeeded in 9.0s after 2 restarts and 1 eviction"
