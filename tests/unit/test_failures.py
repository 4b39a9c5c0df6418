from __future__ import annotations

from dataclasses import dataclass

import pytest

from relaunch.core.failures import (
    describe_exit,
    format_report,
    message_from_error_file,
    root_cause_rank,
    signal_name,
    tail_lines,
)
from relaunch.core.group import GroupState, group_state


@dataclass
class F:
    local_rank: int
    pid: int
    exitcode: int
    error_file: str = ""
    message: str = ""
    timestamp: float = 0.0


def test_describe_exit_names_codes_and_signals() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by SIGKILL (signal 9)"
    assert describe_exit(-11) == "killed by SIGSEGV (signal 11)"
    assert signal_name(1) == ""
    assert signal_name(-200) == "signal 200"


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
        3: F(1, 300, -11, message="segfault here", timestamp=20.0),
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
    assert lines[-1] == "Stopped because of the failure (not failures): ranks 0, 2"


@pytest.mark.parametrize(
    ("codes", "state"),
    [
        ({0: None, 1: None}, GroupState.RUNNING),
        ({0: 0, 1: None}, GroupState.RUNNING),
        ({0: 0, 1: 0}, GroupState.SUCCEEDED),
        ({0: 1, 1: None}, GroupState.FAILED),
        ({0: 0, 1: -9}, GroupState.FAILED),
    ],
)
def test_group_state(codes: dict[int, int | None], state: GroupState) -> None:
    assert group_state(codes) is state
