"""Expiry timers with real processes: the file (FIFO) and local (queue) pairs, and the agent's
``--timers`` and ``--hang-timeout``."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import LeakCheck, wait_until

from relaunch.core.workers.timers import Timer
from relaunch.runtime import ManualClock
from relaunch.timer import (
    FileTimerServer,
    LocalTimerClient,
    LocalTimerServer,
    RequestQueue,
    TimerRequest,
    configure,
    expires,
)
from relaunch.timer.base import TableTimerServer
from relaunch.timer.file_based_local_timer import FileTimerClient, FileTimerRequest

pytestmark = pytest.mark.timeout(60)


class Reaps:
    """What a server reaped: (worker, scopes, when) in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, list[Timer], float]] = []
        self.lock = threading.Lock()

    def __call__(self, worker: Any, timers: list[Timer]) -> None:
        with self.lock:
            self.seen.append((worker, timers, time.time()))

    def scopes(self, worker: Any) -> list[str]:
        return [t.scope for w, timers, _ in self.seen if w == worker for t in timers]


@pytest.fixture
def reaps() -> Reaps:
    return Reaps()


@pytest.fixture
def file_server(tmp_path, reaps: Reaps) -> Iterator[FileTimerServer]:
    server = FileTimerServer(str(tmp_path / "timers.fifo"), "run", max_interval=0.1, on_reap=reaps)
    server.start()
    yield server
    server.stop()
    assert not os.path.exists(server.file_path), "the server removes the FIFO it made"


def worker(leaks: LeakCheck, fifo: str, body: str) -> subprocess.Popen[str]:
    """A Python process that runs ``body`` with ``relaunch.timer`` pointed at ``fifo``."""
    code = "import sys, relaunch.timer as timer\n" + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=leaks.process_env(TORCHELASTIC_TIMER_FILE=fifo),
    )


HANG = "sys.stdin.read()  # until the test closes stdin, or the process is reaped\n"


def test_a_worker_stuck_past_its_deadline_is_reaped_on_time(
    leaks: LeakCheck, file_server: FileTimerServer, reaps: Reaps
) -> None:
    stuck = worker(
        leaks,
        file_server.file_path,
        f"""
        with timer.expires(after=0.5, scope="stuck"):
            {HANG}
    """,
    )
    assert stuck.wait(timeout=30) == -signal.SIGKILL
    [(pid, timers, reaped_at)] = reaps.seen
    assert pid == stuck.pid and [t.scope for t in timers] == ["stuck"]
    assert timers[0].allowed == pytest.approx(0.5, abs=0.2)
    late = reaped_at - timers[0].deadline
    assert 0 <= late < 0.1 + 0.4, f"reaped {late * 1000:.0f} ms after the deadline"


def test_a_released_timer_never_fires(
    leaks: LeakCheck, file_server: FileTimerServer, reaps: Reaps
) -> None:
    # The second timer, with a later deadline, is the clock: once it fired, the first one's
    # deadline had long passed.
    proc = worker(
        leaks,
        file_server.file_path,
        f"""
        with timer.expires(after=0.2, scope="released"):
            pass
        with timer.expires(after=0.6, scope="later"):
            {HANG}
    """,
    )
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert reaps.scopes(proc.pid) == ["later"]


def test_scopes_and_workers_are_independent(
    leaks: LeakCheck, file_server: FileTimerServer, reaps: Reaps
) -> None:
    first = worker(
        leaks,
        file_server.file_path,
        f"""
        with timer.expires(after=30, scope="outer"):
            with timer.expires(after=0.4, scope="inner"):
                {HANG}
    """,
    )
    second = worker(
        leaks,
        file_server.file_path,
        f"""
        with timer.expires(after=30, scope="inner"):
            print("holding", flush=True)
            {HANG}
        print("released", flush=True)
    """,
    )
    assert second.stdout is not None and second.stdout.readline() == "holding\n"
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert reaps.scopes(first.pid) == ["inner"]
    out, _ = second.communicate("", timeout=30)  # the same scope of another worker lives on
    assert second.returncode == 0 and out == "released\n"
    assert reaps.scopes(second.pid) == []


def test_stop_returns_at_once_whatever_the_interval(tmp_path) -> None:
    server = FileTimerServer(str(tmp_path / "fifo"), "run", max_interval=60)
    local = LocalTimerServer(multiprocessing.get_context("spawn").Queue(), max_interval=60)
    for each in (server, local):
        each.start()
        started = time.monotonic()
        each.stop()
        assert time.monotonic() - started < 1.0


def test_malformed_requests_are_logged_and_ignored(
    leaks: LeakCheck, file_server: FileTimerServer, reaps: Reaps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    fd = os.open(file_server.file_path, os.O_WRONLY)
    os.write(fd, b'garbage\n{"pid": -4}\n{"pid": 1, "scope_id": "s"')  # the last is partial
    os.write(fd, b"\n" + b"x" * 100_000 + b"\n")
    os.close(fd)
    wait_until(
        lambda: sum("malformed" in r.message for r in caplog.records) >= 4,
        what="four malformed requests logged",
    )
    proc = worker(
        leaks,
        file_server.file_path,
        f"""
        with timer.expires(after=0.3, scope="after-garbage"):
            {HANG}
    """,
    )
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the server still works"


def test_the_server_never_signals_its_own_process(
    file_server: FileTimerServer, reaps: Reaps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    client = FileTimerClient(file_server.file_path)
    fd = os.open(file_server.file_path, os.O_WRONLY)
    request = FileTimerRequest(os.getpid(), "self", time.time() - 1, signal.SIGKILL)
    os.write(fd, (request.to_json() + "\n").encode())
    os.close(fd)
    wait_until(
        lambda: any("not reaping pid" in r.message for r in caplog.records),
        what="the refusal logged",
    )
    assert reaps.seen == []
    client.release("self")


def test_reaping_is_limited_to_the_pids_the_server_may_reap(
    tmp_path, leaks: LeakCheck, reaps: Reaps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    server = FileTimerServer(
        str(tmp_path / "fifo"), "run", max_interval=0.1, on_reap=reaps, may_reap=lambda pid: False
    )
    server.start()
    try:
        proc = worker(
            leaks,
            server.file_path,
            f"""
            with timer.expires(after=0.2, scope="protected"):
                {HANG}
        """,
        )
        wait_until(
            lambda: any("not one of this agent's workers" in r.message for r in caplog.records),
            what="the refusal",
        )
        assert proc.poll() is None and reaps.seen == []
        proc.communicate("", timeout=30)
        assert proc.returncode == 0
    finally:
        server.stop()


def test_client_errors_say_what_is_wrong(tmp_path) -> None:
    regular = tmp_path / "regular"
    regular.write_text("")
    fifo = str(tmp_path / "unread.fifo")
    os.mkfifo(fifo)
    for path, error, message in [
        (str(regular), ValueError, "is not a FIFO"),
        (str(tmp_path / "missing"), BrokenPipeError, "no timer server reads .* does not exist"),
        (fifo, BrokenPipeError, "no timer server reads"),
    ]:
        with pytest.raises(error, match=message), expires(after=1, client=FileTimerClient(path)):
            pass
    server = FileTimerServer(str(regular), "run")
    with pytest.raises(ValueError, match="is not a FIFO"):
        server.start()


def _local_worker(queue: Any, scopes: list[tuple[str, float, bool]]) -> None:
    configure(LocalTimerClient(queue))
    for scope, after, hang in scopes:
        with expires(after=after, scope=scope):
            if hang:
                threading.Event().wait()


def test_the_local_pair_reaps_over_a_multiprocessing_queue(reaps: Reaps) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    server = LocalTimerServer(queue, max_interval=0.1, on_reap=reaps)
    server.start()
    try:
        proc = context.Process(
            target=_local_worker, args=(queue, [("released", 0.2, False), ("stuck", 0.5, True)])
        )
        proc.start()
        proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGKILL
        assert reaps.scopes(proc.pid) == ["stuck"]
    finally:
        server.stop()
        queue.close()
        queue.join_thread()


def test_a_handed_over_worker_is_not_signalled_and_a_named_signal_is_kept(
    tmp_path, leaks: LeakCheck, reaps: Reaps
) -> None:
    """``hand_over`` (the agent's) takes a worker whose request named SIGKILL, the clients'
    default, in place of the signal; one that named SIGTERM is still reaped with it."""
    handed = Reaps()
    server = FileTimerServer(
        str(tmp_path / "timers.fifo"), "run", 0.1, on_reap=reaps, hand_over=handed
    )
    server.start()
    default = worker(
        leaks, server.file_path, f"with timer.expires(after=0.3, scope='a'):\n    {HANG}"
    )
    named = worker(
        leaks,
        server.file_path,
        f"""
        import os, signal
        fifo = os.environ["TORCHELASTIC_TIMER_FILE"]
        timer.configure(timer.FileTimerClient(fifo, signal.SIGTERM))
        with timer.expires(after=0.3, scope="b"):
            {HANG}
    """,
    )
    try:
        assert named.wait(timeout=30) == -signal.SIGTERM
        wait_until(lambda: handed.scopes(default.pid) == ["a"], what="the hand-over")
        assert default.poll() is None, "handed over, not signalled"
        assert reaps.scopes(named.pid) == ["b"] and reaps.scopes(default.pid) == []
    finally:
        server.stop()
        default.kill()
        default.communicate(timeout=30)


def test_the_agents_watch_takes_every_ranks_stack_when_a_timer_expires(leaks: LeakCheck) -> None:
    """Under the agent (``ExpiryWatch``) the reaper thread only hands an expired worker over and
    wakes the agent; the agent's ``check`` asks it and every other running rank for its stack
    (SIGABRT), and names the hang, as for an overdue section."""
    from relaunch.agent.expiry import ExpiryWatch
    from relaunch.core.run.run_events import NodeSnapshot, RankSample

    watch = ExpiryWatch("run", timers=True, hang_timeout=None)
    woken = threading.Event()
    watch.start(woken.set)
    env = leaks.process_env(**watch.worker_env())
    bodies = [HANG, f"with timer.expires(after=0.3, scope='step'):\n    {HANG}"]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys, relaunch.timer as timer\n" + body],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            process_group=0,  # the watch reaps the process groups its ranks lead
        )
        for body in bodies
    ]
    try:
        samples = {0: RankSample(None), 1: RankSample(None)}
        watch.watch(
            {rank: proc.pid for rank, proc in enumerate(ranks)},
            {0: [], 1: []},
            lambda: NodeSnapshot(time.time(), samples),
        )
        assert woken.wait(timeout=30), "the reaper thread wakes the agent"
        assert watch.hang is None and ranks[1].poll() is None, "nothing done on its thread"
        watch.check()
        assert watch.hang == (
            "local rank 1 is hung (expiry timer 'step' expired: the block was given 0.3s)"
        )
        assert [proc.wait(timeout=10) for proc in ranks] == [-signal.SIGABRT] * 2
        assert all(b"Fatal Python error: Aborted" in proc.stderr.read() for proc in ranks)
    finally:
        watch.close()
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)


# -- the agent ---------------------------------------------------------------------------------

TIMER_JOB = """
    import os, sys, time
    import relaunch.timer as timer
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with timer.expires(after=0.5, scope="train_step"):
        if attempt == 0 and os.environ["LOCAL_RANK"] == "1":
            time.sleep(600)  # stuck until reaped
    print("finished attempt", attempt, flush=True)
"""

HANG_JOB = """
    import os, threading
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    def load_batches():
        threading.Event().wait()  # a data loader that never delivers
    if attempt == 0 and os.environ["LOCAL_RANK"] == "0":
        loader = threading.Thread(target=load_batches, daemon=True)
        loader.start()
        loader.join()
    print("finished attempt", attempt, flush=True)
"""


def relaunch(
    leaks: LeakCheck, tmp_path, job: str, *flags: str, **env: str
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(job))
    return subprocess.run(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", *flags, str(path)],
        capture_output=True,
        text=True,
        env=leaks.process_env(**env),
        timeout=60,
    )


def test_a_reaped_worker_restarts_the_group_and_the_report_names_the_scope(
    tmp_path, leaks: LeakCheck
) -> None:
    done = relaunch(leaks, tmp_path, TIMER_JOB, "--timers", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("finished attempt 1") == 2
    assert "expiry timer 'train_step' expired: the block was given 0.5s" in done.stderr
    # the agent takes a reaped worker's stack (SIGABRT) before it ends, as for any hang
    assert "killed by SIGABRT" in done.stderr and "restarting the worker group" in done.stderr
    assert 'job.py", line 7 in <module>' in done.stderr, "where it was stuck"


def test_torchruns_switch_turns_timers_on_and_a_last_failure_is_reported(
    tmp_path, leaks: LeakCheck
) -> None:
    done = relaunch(leaks, tmp_path, TIMER_JOB, TORCHELASTIC_ENABLE_FILE_TIMER="1")
    assert done.returncode == 1
    report = done.stderr[done.stderr.index("Root cause") :]
    assert "rank 1 (local_rank 1" in report
    assert "expiry timer 'train_step' expired" in report and "@relaunch.record" not in report
    # rank 0 had finished when rank 1's timer expired: it is not hung, nor a rank without a stack
    assert "rank 1 alone gave a stack" in report and "rank 0 gave no Python stack" not in report


def test_a_hung_worker_is_shown_with_its_stack_and_restarted(tmp_path, leaks: LeakCheck) -> None:
    done = relaunch(leaks, tmp_path, HANG_JOB, "--hang-timeout", "1", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("finished attempt 1") == 2
    assert "local rank 1" not in done.stderr, "a worker that finished is not hung"
    report = done.stderr[done.stderr.index("Root cause") :]
    assert "killed by SIGABRT" in report and "hung: no output, progress or timer activity" in report
    assert "Fatal Python error: Aborted" in report
    assert 'job.py", line 5 in load_batches' in report, "the hung thread's stack"


def test_a_quiet_worker_that_prints_now_and_then_is_not_hung(tmp_path, leaks: LeakCheck) -> None:
    job = """
        import time
        for i in range(6):
            print("tick", i, flush=True)
            time.sleep(0.3)  # quiet for less than the hang timeout
    """
    done = relaunch(leaks, tmp_path, job, "--hang-timeout", "1", "--max-restarts", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("tick 5") == 2 and "SIGABRT" not in done.stderr


class ScriptedQueue(RequestQueue):
    """Requests already waiting, handed out one per ``get`` as a slow server would see them."""

    def __init__(self, requests: list[TimerRequest]) -> None:
        self.requests = list(requests)

    def size(self) -> int:
        return 1

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        return [self.requests.pop(0)] if self.requests else []


def test_a_release_queued_behind_other_requests_still_wins(leaks: LeakCheck, reaps: Reaps) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=leaks.process_env(),
    )
    past = time.time() - 1  # the server wakes late: the deadline has passed, the release came
    queue = ScriptedQueue(
        [
            TimerRequest(proc.pid, "a", past),
            TimerRequest(proc.pid, "b", past + 99),
            TimerRequest(proc.pid, "c", past + 99),
            TimerRequest(proc.pid, "a", -1),
        ]
    )
    server = TableTimerServer(queue, max_interval=0.1, on_reap=reaps)
    server._reap_step()
    assert reaps.seen == [] and proc.poll() is None
    proc.communicate("", timeout=30)


def test_a_report_says_how_long_the_worker_gave_itself_however_late_it_was_read(
    leaks: LeakCheck, reaps: Reaps
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=leaks.process_env(),
    )
    made = time.time() - 2.0  # the request waited 2 s in the pipe before the server read it
    server = TableTimerServer(
        ScriptedQueue([FileTimerRequest(proc.pid, "step", made + 0.5, acquired_at=made)]),
        max_interval=0.1,
        on_reap=reaps,
    )
    server._reap_step()
    [(_, [timer], _)] = reaps.seen
    assert timer.allowed == pytest.approx(0.5)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_the_reaper_reads_its_deadlines_from_its_clock(leaks: LeakCheck, reaps: Reaps) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=leaks.process_env(),
    )
    try:
        clock = ManualClock(time=1000.0)
        queue = ScriptedQueue([TimerRequest(proc.pid, "step", 1010.0)])
        server = TableTimerServer(queue, max_interval=0.1, on_reap=reaps, clock=clock)
        server._reap_step()
        assert reaps.seen == [] and proc.poll() is None, "not due before the clock says so"
        clock.advance(10)
        server._reap_step()
        assert reaps.scopes(proc.pid) == ["step"]
        assert server.last_activity(proc.pid) == 1000.0
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.communicate(timeout=30)
