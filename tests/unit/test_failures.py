from __future__ import annotations

from dataclasses import dataclass

import pytest

from relaunch.core.run.culprit import Verdict
from relaunch.core.run.failures import (
    describe_exit,
    failure_signature,
    format_report,
    headline,
    message_from_error_file,
    one_line,
    root_cause_rank,
    signal_meaning,
    signal_name,
    stderr_tail_message,
    tail_lines,
)
from relaunch.core.run.group import GroupStatus, group_status
from relaunch.procs.process_failure import NO_DETAIL_HINT, ProcessFailure


@dataclass
class F:
    local_rank: int
    pid: int
    exitcode: int
    error_file: str = ""
    details: str = ""
    timestamp: float = 0.0
    failed_at: float = 0.0


def test_describe_exit_names_codes_and_signals() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by SIGKILL (signal 9)"
    assert describe_exit(-11) == "killed by SIGSEGV (signal 11)"
    assert signal_name(1) == ""
    assert signal_name(-200) == "signal 200"


def test_a_failure_signature_is_its_exception_and_last_place_not_its_time_or_rank() -> None:
    trace = (
        "Traceback (most recent call last):\n"
        '  File "/job/train.py", line 40, in <module>\n    main()\n'
        '  File "/job/train.py", line 12, in step\n    1 / 0\n'
        "ZeroDivisionError: division by zero"
    )
    one = F(0, 11, 1, details=trace, timestamp=5.0)
    again = F(3, 99, 1, details=trace, timestamp=90.0)
    assert (
        failure_signature(one)
        == failure_signature(again)
        == ('ZeroDivisionError: division by zero at File "/job/train.py", line 12, in step')
    )
    elsewhere = F(0, 11, 1, details=trace.replace("line 12", "line 13"))
    assert failure_signature(elsewhere) != failure_signature(one)
    assert failure_signature(F(0, 1, -9)) == "killed by SIGKILL (signal 9)"


def test_error_file_message_prefers_the_traceback() -> None:
    extra = {"py_callstack": "TB\nValueError: x\n"}
    data = {"message": {"message": "ValueError: x", "extraInfo": extra}}
    assert message_from_error_file(data) == "TB\nValueError: x"
    assert message_from_error_file({"message": {"message": "only text"}}) == "only text"
    assert message_from_error_file({"message": "plain"}) == "plain"
    assert message_from_error_file({}) == ""
    assert message_from_error_file({"message": 5}) == ""


def test_tail_lines_keeps_the_last_lines() -> None:
    text = "".join(f"{i}\n" for i in range(100))
    assert tail_lines(text, 3) == "97\n98\n99"


def test_root_cause_is_the_earliest_failure_then_the_lowest_rank() -> None:
    failures = {
        4: F(0, 1, 1, timestamp=5.0),
        2: F(1, 2, 1, timestamp=3.0),
        1: F(2, 3, 1, timestamp=3.0),
    }
    assert root_cause_rank(failures) == 1
    with pytest.raises(ValueError):
        root_cause_rank({})


def test_report_puts_the_root_cause_first_and_stopped_ranks_apart() -> None:
    failures = {
        3: F(1, 300, -11, details="segfault here", timestamp=20.0),
        1: F(1, 100, 2, "/logs/1/error.json", "Traceback\nValueError: boom", timestamp=10.0),
    }
    report = format_report("train", failures, "hostA", stopped=[2, 0])
    lines = report.splitlines()
    assert lines[0] == "train failed: 2 workers failed, 2 stopped because of it"
    assert lines[1] == "Root cause (first failure):"
    assert lines[2].startswith("  rank 1 (local_rank 1, host hostA, pid 100) exited with code 2")
    assert "error file: /logs/1/error.json" in lines[3]
    assert "    ValueError: boom" in lines
    assert report.index("Other failures:") < report.index("rank 3 (")
    assert "killed by SIGSEGV (signal 11)" in report
    assert (
        lines[-1] == "Ranks 0, 2 did not fail: relaunch stopped them because of the failures above"
    )


HUNG = {rank: F(rank, 100 + rank, -6, details="hung", timestamp=10.0 - rank) for rank in range(2)}
NAMED = "rank 1 did not reach the collective that rank 0 waits in (all_reduce): it is in f (x.py:1)"


def test_a_hangs_culprit_here_is_the_root_cause_not_the_first_to_fail() -> None:
    lines = format_report("train", HUNG, "hostA", verdict=Verdict([1], "culprit", NAMED))
    assert lines.splitlines()[1:3] == [
        f"Root cause (a hang, from every rank's stack): {NAMED}",
        "  rank 1 (local_rank 1, host hostA, pid 101) killed by SIGABRT (signal 6) at "
        + lines.splitlines()[2].split(" at ", 1)[1],
    ]
    assert "Other failures:\n  rank 0 (" in lines


def test_a_hangs_culprit_on_another_node_is_named_and_every_rank_here_listed() -> None:
    named = NAMED.replace("rank 1 did", "rank 7 did")
    lines = format_report("train", HUNG, "hostA", verdict=Verdict([7], "culprit", named))
    assert lines.splitlines()[1:4] == [
        f"Root cause (a hang, from every rank's stack): {named}",
        "  not on this node: its report there shows the stack",
        "Other failures:",
    ]
    assert "  rank 0 (" in lines and "  rank 1 (" in lines


def test_a_hang_without_a_culprit_says_so_and_shows_the_first_failure() -> None:
    said = "the ranks split evenly (...): relaunch cannot tell which the others wait for"
    lines = format_report("train", HUNG, "hostA", verdict=Verdict([], "split", said)).splitlines()
    assert lines[1] == f"Root cause (a hang, from every rank's stack): {said}"
    assert lines[2].startswith("  rank 1 (local_rank 1,")  # the first to fail, as without


def test_one_stopped_rank_reads_as_a_sentence() -> None:
    report = format_report("train", {1: F(1, 100, 2, details="boom")}, "hostA", stopped=[0])
    assert report.splitlines()[-1] == (
        "Rank 0 did not fail: relaunch stopped it because of the failure above"
    )


def test_ranks_kept_to_restart_in_place_are_told_apart_from_the_stopped() -> None:
    report = format_report(
        "train", {1: F(1, 100, 2, details="boom")}, "hostA", stopped=[0, 2, 3], kept=[2, 3]
    )
    lines = report.splitlines()
    assert lines[0] == "train failed: 1 worker failed, 3 stopped because of it"
    assert lines[-2:] == [
        "Rank 0 did not fail: relaunch stopped it because of the failure above",
        "Ranks 2, 3 did not fail: they wait to restart in place",
    ]


def test_a_signal_is_explained_not_answered_with_record_or_redirects() -> None:
    assert signal_meaning(-9) == (
        "SIGKILL: killed from outside, most often by the out-of-memory killer (see dmesg) "
        "or a scheduler"
    )
    assert signal_meaning(-11).startswith("SIGSEGV: a crash in native code")
    assert signal_meaning(-7).startswith("SIGBUS: a bad memory access")
    assert signal_meaning(1) == signal_meaning(0) == ""
    assert signal_meaning(-200) == ""
    # No error file and no stderr log: the meaning stands where the hint was.
    killed = ProcessFailure.from_exit(0, 10, -9, "", stderr_file="", timestamp=1.0)
    assert killed.details == ""
    report = format_report("train", {0: killed}, "hostA")
    assert "@relaunch.record" not in report and "-r 2" not in report
    assert report.splitlines()[-1] == "    " + signal_meaning(-9)
    # An exit code can still be explained by an error file: the hint stays for it.
    exited = ProcessFailure.from_exit(0, 10, 1, "", stderr_file="", timestamp=1.0)
    assert exited.details == NO_DETAIL_HINT


def test_the_meaning_comes_before_the_stderr_tail_but_not_after_a_watchdog_cause() -> None:
    tail = stderr_tail_message("/logs/0/stderr.log", "loading shard 7")
    report = format_report("train", {0: F(0, 10, -9, details=tail)}, "hostA")
    assert report.splitlines()[-3:] == [
        "    " + signal_meaning(-9),
        "    last lines of stderr (/logs/0/stderr.log):",
        "    loading shard 7",
    ]
    reaped = "expiry timer 'step' expired: the block was given 5s; relaunch reaped it"
    report = format_report("train", {0: F(0, 10, -9, details=reaped)}, "hostA")
    assert "SIGKILL:" not in report and report.splitlines()[-1] == "    " + reaped


@pytest.mark.parametrize(
    ("message", "line"),
    [
        ("", ""),
        ("ValueError: boom", "ValueError: boom"),
        ("Traceback (most recent call last):\n  File x\nValueError: boom\n", "ValueError: boom"),
        (stderr_tail_message("/l/stderr.log", "a\nb\nlast words"), "last words"),
        ("last lines of stderr (/l/stderr.log):\n", ""),
        (
            "hung: no progress for 30s\nstack of every thread when it hung (x):",
            "hung: no progress for 30s",
        ),
    ],
)
def test_headline_skips_a_heading(message: str, line: str) -> None:
    assert headline(message) == line


WARNED = (
    "/w/train.py:234: FutureWarning: `broadcast_buffers` is deprecated.\n"
    "  ddp = nn.parallel.DistributedDataParallel(\n"
)


@pytest.mark.parametrize(
    ("tail", "line"),
    [
        (WARNED, ""),  # killed after a warning: the warning is not why
        ("step 7\n" + WARNED, "step 7"),
        (
            WARNED + "Traceback (most recent call last):\n  File x\nValueError: boom",
            "ValueError: boom",
        ),
        ("/w/x.py:1: UserWarning: careful\n  x()\n  y()\nsaving", "saving"),
    ],
)
def test_a_python_warning_in_the_stderr_tail_is_never_the_headline(tail: str, line: str) -> None:
    assert headline(stderr_tail_message("/l/stderr.log", tail)) == line
    assert one_line(3, F(0, 1, -9, details=stderr_tail_message("/l/stderr.log", tail))) == (
        "rank 3 killed by SIGKILL (signal 9)" + (f": {line}" if line else "")
    )


def test_one_line_never_ends_with_a_heading() -> None:
    tail = stderr_tail_message("/l/stderr.log", "Traceback: boom")
    assert one_line(0, F(0, 1, 3, details=tail)) == "rank 0 exited with code 3: Traceback: boom"
    assert one_line(2, F(0, 1, -9)) == "rank 2 killed by SIGKILL (signal 9)"
    assert (
        one_line(1, F(0, 1, 1, details="x" * 200), width=10)
        == "rank 1 exited with code 1: xxxxxxx..."
    )


@pytest.mark.parametrize(
    ("codes", "state"),
    [
        ({0: None, 1: None}, GroupStatus.RUNNING),
        ({0: 0, 1: None}, GroupStatus.RUNNING),
        ({0: 0, 1: 0}, GroupStatus.SUCCEEDED),
        ({0: 1, 1: None}, GroupStatus.FAILED),
        ({0: 0, 1: -9}, GroupStatus.FAILED),
    ],
)
def test_group_state(codes: dict[int, int | None], state: GroupStatus) -> None:
    assert group_status(codes) is state


def test_a_stderr_tail_kept_in_memory_says_why_the_log_lacks_it() -> None:
    message = stderr_tail_message(
        "/logs/0/stderr.log", "RuntimeError: boom", "[Errno 28] No space left on device"
    )
    assert message.startswith(
        "last lines of stderr (kept in memory: /logs/0/stderr.log is incomplete, "
        "[Errno 28] No space left on device):\n"
    )
    assert headline(message) == "RuntimeError: boom"
    failure = ProcessFailure.from_exit(
        0, 1, 1, "", "/logs/0/stderr.log", 1.0, b"Traceback\nRuntimeError: boom\n", "[Errno 5]"
    )
    assert failure.details.endswith("Traceback\nRuntimeError: boom")
    assert "is incomplete, [Errno 5]" in failure.details
