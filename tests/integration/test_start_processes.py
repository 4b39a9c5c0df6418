"""start_processes with real processes: results, logs, tee, failures, stopping, bad input."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import procfns
import pytest
from conftest import LeakCheck, pid_alive, wait_until

from relaunch import (
    ChildFailedError,
    MultiprocessContext,
    ProcessFailure,
    Std,
    SubprocessContext,
    start_processes,
)
from relaunch.core.workers.rank_io import plan_rank_io
from relaunch.runtime import ManualClock

PY = sys.executable
pytestmark = pytest.mark.timeout(60)


def py(code: str) -> tuple[str, ...]:
    return ("-c", textwrap.dedent(code))


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read()


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_function_return_values_by_rank(log_dir: str, leaks: LeakCheck, start_method: str) -> None:
    pc = start_processes(
        "fn",
        procfns.echo_rank,
        {0: ("a",), 1: ("b",)},
        leaks.envs(2),
        log_dir,
        start_method=start_method,
    )
    try:
        assert isinstance(pc, MultiprocessContext)
        result = pc.wait()
    finally:
        pc.close()
    assert result is not None and not result.is_failed()
    mark = leaks.mark[:4]
    assert result.return_values == {0: f"a:0:{mark}", 1: f"b:1:{mark}"}


def test_binary_gets_args_env_and_local_rank_macro(log_dir: str, leaks: LeakCheck) -> None:
    code = "import os, sys; print(sys.argv[1], os.environ['LOCAL_RANK'], os.environ['COLOR'])"
    args = {r: (*py(code), "arg-${local_rank}") for r in range(3)}
    envs = {r: {**env, "COLOR": f"c{r}"} for r, env in leaks.envs(3).items()}
    pc = start_processes("bin", PY, args, envs, log_dir, redirects=Std.OUT)
    result = pc.wait()
    pc.close()
    assert isinstance(pc, SubprocessContext)
    assert result is not None and result.return_values == {0: None, 1: None, 2: None}
    for rank in range(3):
        assert read(result.stdouts[rank]) == f"arg-{rank} {rank} c{rank}\n"
        assert result.stderrs[rank] == ""


def test_redirect_goes_to_files_only(log_dir: str, leaks: LeakCheck, capfd) -> None:
    code = "import sys; print('out line'); print('err line', file=sys.stderr)"
    pc = start_processes("w", PY, {0: py(code)}, leaks.envs(1), log_dir, redirects=Std.ALL)
    result = pc.wait()
    pc.close()
    assert result is not None
    assert read(os.path.join(log_dir, "0", "stdout.log")) == "out line\n"
    assert read(os.path.join(log_dir, "0", "stderr.log")) == "err line\n"
    captured = capfd.readouterr()
    assert "out line" not in captured.out and "err line" not in captured.err


def test_tee_prefixes_whole_lines_on_the_console_and_keeps_every_byte(
    log_dir: str, leaks: LeakCheck, capfd
) -> None:
    # Two ranks write long lines in small pieces, then a last line without newline and bad UTF-8.
    code = """
    import os, sys
    rank = os.environ['LOCAL_RANK']
    for i in range(300):
        for piece in (f'r{rank}-{i}-', 'x' * 500, '-end\\n'):
            sys.stdout.write(piece); sys.stdout.flush()
    sys.stdout.buffer.write(b'tail \\xff\\xfe no newline'); sys.stdout.flush()
    print('an error line', file=sys.stderr)
    """
    pc = start_processes(
        "trainer", PY, {0: py(code), 1: py(code)}, leaks.envs(2), log_dir, tee=Std.ALL
    )
    result = pc.wait()
    pc.close()
    assert result is not None and not result.is_failed()
    captured = capfd.readouterr()
    out_lines = captured.out.splitlines()
    for rank in range(2):
        mine = [line for line in out_lines if line.startswith(f"[trainer{rank}]:")]
        assert mine[:300] == [f"[trainer{rank}]:r{rank}-{i}-{'x' * 500}-end" for i in range(300)]
        assert mine[300].startswith(f"[trainer{rank}]:tail ") and mine[300].endswith("no newline")
        with open(os.path.join(log_dir, str(rank), "stdout.log"), "rb") as file:
            log = file.read()
        assert log.endswith(b"tail \xff\xfe no newline")
        assert log.count(b"\n") == 300
    assert len(out_lines) == 602, "no extra, split or interleaved lines"
    assert "[trainer0]:an error line" in captured.err.splitlines()


def test_no_line_lost_when_a_worker_is_killed(log_dir: str, leaks: LeakCheck, capfd) -> None:
    code = """
    import os, signal, sys
    for i in range(5000):
        print(f'line {i}')
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
    pc = start_processes("w", PY, {0: py(code)}, leaks.envs(1), log_dir, tee=Std.OUT)
    result = pc.wait()
    pc.close()
    assert result is not None and result.failures[0].exitcode == -signal.SIGKILL
    expected = [f"line {i}" for i in range(5000)]
    assert read(os.path.join(log_dir, "0", "stdout.log")).splitlines() == expected
    assert capfd.readouterr().out.splitlines() == [f"[w0]:{line}" for line in expected]


def test_function_worker_output_is_redirected(log_dir: str, leaks: LeakCheck) -> None:
    pc = start_processes(
        "fn",
        procfns.print_lines,
        {0: (3,)},
        leaks.envs(1),
        log_dir,
        redirects=Std.ALL,
    )
    assert pc.wait() is not None
    pc.close()
    assert read(os.path.join(log_dir, "0", "stdout.log")).splitlines() == [
        "line 0 of rank 0",
        "line 1 of rank 0",
        "line 2 of rank 0",
    ]
    assert read(os.path.join(log_dir, "0", "stderr.log")) == "to stderr\n"


def test_one_failure_stops_the_rest_and_names_the_root_cause(
    log_dir: str, leaks: LeakCheck
) -> None:
    pc = start_processes(
        "trainer", procfns.fail_on_rank, dict.fromkeys(range(3), (1,)), leaks.envs(3), log_dir
    )
    pids = pc.pids()
    result = pc.wait()
    pc.close()
    assert result is not None and result.is_failed()
    assert set(result.failures) == {1}
    assert set(result.stopped) == {0, 2}
    failure = result.failures[1]
    assert failure.exitcode == 1 and failure.pid == pids[1]
    assert failure.error_file == os.path.join(log_dir, "1", "error.json")
    assert "ValueError: rank 1 cannot go on" in failure.details
    assert "Traceback (most recent call last)" in failure.details
    data = json.loads(read(failure.error_file))
    assert data["message"]["message"] == "ValueError: rank 1 cannot go on"
    assert not any(pid_alive(pid) for pid in pids.values())
    report = str(ChildFailedError("trainer", result.failures, result.stopped))
    assert report.index("Root cause") < report.index("ValueError: rank 1 cannot go on")
    assert "Ranks 0, 2 did not fail: relaunch stopped them because of the failure above" in report


def test_binary_failure_carries_the_stderr_tail(log_dir: str, leaks: LeakCheck) -> None:
    code = "import sys; [print(f'noise {i}', file=sys.stderr) for i in range(50)]; sys.exit(7)"
    pc = start_processes("w", PY, {0: py(code)}, leaks.envs(1), log_dir, redirects=Std.ERR)
    result = pc.wait()
    pc.close()
    assert result is not None
    failure = result.failures[0]
    assert failure.exitcode == 7
    assert failure.error_file == "<N/A>"  # as torch says it
    assert "noise 49" in failure.details and "noise 29" not in failure.details


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
def test_death_by_signal_is_named(log_dir: str, leaks: LeakCheck, sig: signal.Signals) -> None:
    pc = start_processes("w", procfns.kill_self, {0: (int(sig),)}, leaks.envs(1), log_dir)
    result = pc.wait()
    pc.close()
    assert result is not None
    failure = result.failures[0]
    assert failure.exitcode == -sig
    assert failure.signal_name() == sig.name
    assert f"killed by {sig.name}" in str(ChildFailedError("w", result.failures))


def test_system_exit_zero_is_success_and_nonzero_is_failure(log_dir: str, leaks: LeakCheck) -> None:
    pc = start_processes("w", procfns.exit_with, {0: (0,), 1: (4,)}, leaks.envs(2), log_dir)
    result = pc.wait()
    pc.close()
    assert result is not None
    assert set(result.failures) == {1} and result.failures[1].exitcode == 4


def test_unpicklable_return_value_is_a_clear_failure(log_dir: str, leaks: LeakCheck) -> None:
    pc = start_processes("w", procfns.return_unpicklable, {0: ()}, leaks.envs(1), log_dir)
    result = pc.wait()
    pc.close()
    assert result is not None
    assert "cannot be sent to the launcher" in result.failures[0].details


def test_wait_with_zero_timeout_reports_running(log_dir: str, leaks: LeakCheck) -> None:
    pc = start_processes("w", "sleep", {0: ("300",)}, leaks.envs(1), log_dir)
    try:
        assert pc.wait(timeout=0) is None
        assert pc.wait(timeout=0.05) is None
    finally:
        pc.close()
    result = pc.wait(0)
    assert result is not None and set(result.stopped) == {0}


def test_close_stops_every_worker_tree(log_dir: str, leaks: LeakCheck, tmp_path) -> None:
    pid_dir = str(tmp_path / "pids")
    os.mkdir(pid_dir)
    pc = start_processes(
        "w",
        procfns.start_grandchild_and_sleep,
        {0: (pid_dir,), 1: (pid_dir,)},
        leaks.envs(2),
        log_dir,
    )
    wait_until(lambda: len(os.listdir(pid_dir)) == 2, what="both grandchildren to start")
    pids = [int(p) for name in os.listdir(pid_dir) for p in name.split(".")]
    assert all(pid_alive(pid) for pid in pids)
    pc.close()
    assert not any(pid_alive(pid) for pid in pids)
    pc.close()  # idempotent


def test_a_worker_ignoring_sigterm_is_killed_after_the_timeout(
    log_dir: str, leaks: LeakCheck
) -> None:
    code = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print('ready', flush=True)
    time.sleep(300)
    """
    pc = start_processes("w", PY, {0: py(code)}, leaks.envs(1), log_dir, redirects=Std.OUT)
    out = os.path.join(log_dir, "0", "stdout.log")
    wait_until(lambda: read(out) == "ready\n", what="the worker to ignore SIGTERM")
    pc.close(signal.SIGTERM, timeout=0.3)
    result = pc.wait(0)
    assert result is not None and result.stopped == {0: -signal.SIGKILL}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"entrypoint": lambda: 1}, ValueError, "cannot be pickled for start method 'spawn'"),
        ({"entrypoint": "/no/such/binary"}, FileNotFoundError, "does not exist"),
        ({"entrypoint": "no-such-binary-here"}, FileNotFoundError, "not found on PATH"),
        ({"start_method": "vfork"}, ValueError, "unknown start method 'vfork'"),
        ({"envs": {0: {}}}, ValueError, r"envs is missing local ranks \[1\]"),
        ({"args": {0: (), 2: ()}}, ValueError, r"args is missing local ranks \[1\]"),
        ({"args": {}, "envs": {}}, ValueError, "no ranks given"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(
    log_dir: str, leaks: LeakCheck, kwargs: dict, error: type, match: str
) -> None:
    call = {
        "name": "w",
        "entrypoint": procfns.echo_rank,
        "args": {0: ("a",), 1: ("b",)},
        "envs": leaks.envs(2),
        "log_dir": log_dir,
        **kwargs,
    }
    with pytest.raises(error, match=match):
        start_processes(**call)
    assert os.listdir(log_dir) == []


def test_log_dir_must_exist_and_be_empty(tmp_path, leaks: LeakCheck) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="not an existing directory"):
        start_processes("w", "true", {0: ()}, leaks.envs(1), missing)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(ValueError, match="is not empty"):
        start_processes("w", "true", {0: ()}, leaks.envs(1), str(tmp_path / "used"))


def test_process_failure_reads_a_torch_style_error_file(tmp_path) -> None:
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: x",
                    "extraInfo": {
                        "py_callstack": "Traceback...\nRuntimeError: x\n",
                        "timestamp": "1",
                    },
                }
            }
        )
    )
    failure = ProcessFailure(0, 123, 1, str(path))
    assert failure.details == "Traceback...\nRuntimeError: x"
    assert failure.message == json.loads(path.read_text())["message"]  # as torch has it
    assert failure.error_file == str(path)
    assert ProcessFailure(0, 1, -15, str(tmp_path / "none.json")).error_file == "<N/A>"


def test_tee_clears_the_progress_bar_around_worker_lines(
    log_dir: str, leaks: LeakCheck, capfd
) -> None:
    import threading

    events = {"trigger_clear": threading.Event(), "cleared": threading.Event()}
    events["cleared"].set()  # a bar that is always clear: the writer must still raise the trigger
    triggered = threading.Event()

    def watch() -> None:
        if events["trigger_clear"].wait(30):
            triggered.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    pc = start_processes(
        "w",
        PY,
        {0: py("print('a'); print('b')")},
        leaks.envs(1),
        log_dir,
        tee=Std.OUT,
        progbar_events=events,
    )
    pc.wait()
    pc.close()
    watcher.join(30)
    assert triggered.is_set()
    assert not events["trigger_clear"].is_set()
    assert capfd.readouterr().out == "\r[w0]:a\033[K\n\r[w0]:b\033[K\n"


def test_a_second_stop_brings_the_sigkill_closer(log_dir: str, leaks: LeakCheck, tmp_path) -> None:
    go = tmp_path / "go"
    code = f"""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print('ready', flush=True)
    if os.environ['LOCAL_RANK'] == '1':
        while not os.path.exists({str(go)!r}):
            time.sleep(0.005)
        sys.exit(1)
    time.sleep(300)
    """
    pc = start_processes(
        "w",
        PY,
        {0: py(code), 1: py(code)},
        leaks.envs(2),
        log_dir,
        redirects=Std.OUT,
        shutdown_timeout=300,
    )
    wait_until(
        lambda: all(read(os.path.join(log_dir, r, "stdout.log")) == "ready\n" for r in "01"),
        what="both ranks to ignore SIGTERM and SIGINT",
    )
    go.touch()
    # Rank 1 fails: rank 0 gets SIGTERM, which it ignores, with 300 s before SIGKILL ...
    assert pc.wait(timeout=0.2) is None
    # ... until a close with a short timeout brings the SIGKILL closer.
    pc.close(signal.SIGINT, timeout=0.2)
    result = pc.wait(0)
    assert result is not None
    assert set(result.failures) == {1} and result.stopped == {0: -signal.SIGKILL}


def test_a_context_runs_a_plan_of_rank_io_and_reads_its_clock(
    log_dir: str, leaks: LeakCheck
) -> None:
    plan = plan_rank_io("w", log_dir, 2, redirects=Std.OUT, tee={1: Std.ERR})
    for io in plan.values():
        os.mkdir(io.log_dir)
    code = "import sys; print('out', sys.argv[1]); print('err', sys.argv[1], file=sys.stderr)"
    args = {rank: (*py(code), str(rank)) for rank in range(2)}
    pc = SubprocessContext("w", PY, args, leaks.envs(2), plan, clock=ManualClock())
    pc.start()
    try:
        result = pc.wait()
    finally:
        pc.close()
    assert result is not None and not result.is_failed()
    assert result.durations == {0: 0.0, 1: 0.0}, "the exits are timed on the context's clock"
    assert pc.stdouts == {rank: plan[rank].stdout for rank in range(2)}
    assert pc.tee_stderrs == {1: plan[1].stderr} and pc.tee_stdouts == {}
    assert pc.error_files == {rank: plan[rank].error_file for rank in range(2)}
    assert [read(result.stdouts[rank]) for rank in range(2)] == ["out 0\n", "out 1\n"]
    assert read(plan[1].stderr) == "err 1\n"
