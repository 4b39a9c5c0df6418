"""Bounded teardown: a worker that does not die after SIGKILL must not hang the launcher.

Two real stand-ins for an unkillable worker, each controlled and released by the test:

* a cgroup v1 freezer: a frozen process is in uninterruptible sleep (state D) and SIGKILL does
  not take it until the cgroup is thawed; it keeps its pipes open, as a worker stuck in a
  driver does;
* a tracer (PTRACE_SEIZE from a helper process that never waits): a traced process that is
  killed becomes a zombie that its real parent cannot reap until the tracer lets it go.

Each test stops the group, checks that the stop returns within the deadline (plus slack for a
loaded machine), that the warning names the pid and its state, that no output was lost, then
releases the stand-in and reaps the worker.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, pid_alive, wait_until

from relaunch import PContext, Std, start_processes
from relaunch.procs.handles import StuckWorker
from relaunch.procs.monitor import KILL_DEADLINE

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
#: The grace between SIGTERM and SIGKILL in these tests.
GRACE = 0.3
#: Room for a loaded two-core machine on top of ``GRACE + KILL_DEADLINE``.
SLACK = 3.0
LINES = 2000
FREEZER_ROOT = "/sys/fs/cgroup/freezer"

#: A worker that prints LINES numbered lines, then "ready", then sleeps until stopped.
PRINT_THEN_SLEEP = f"""
import os, sys, time
rank = os.environ["LOCAL_RANK"]
for i in range({LINES}):
    print(f"rank {{rank}} line {{i}}")
print("ready", flush=True)
time.sleep(300)
"""

#: Holds a PTRACE_SEIZE on the pid in argv[1] until its stdin ends, never waiting for it.
TRACER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_SEIZE = 0x4206
if libc.ptrace(PTRACE_SEIZE, int(sys.argv[1]), None, None) != 0:
    print("error", os.strerror(ctypes.get_errno()), flush=True)
    sys.exit(1)
print("attached", flush=True)
sys.stdin.read()
"""


def expected_lines(rank: int) -> str:
    return "".join(f"rank {rank} line {i}\n" for i in range(LINES)) + "ready\n"


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read()


def state_letter(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as file:
        stat = file.read()
    return stat[stat.rindex(")") + 2]


def reap(pid: int, timeout: float = 10.0) -> int:
    """The wait status of our child ``pid``, once it can be reaped (within ``timeout`` s)."""
    statuses = []

    def reaped() -> bool:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            statuses.append(status)
        return bool(got)

    wait_until(reaped, timeout, f"worker {pid} to be reaped")
    return statuses[0]


class Freezer:
    """A cgroup v1 freezer of the test's own: what is frozen in it ignores SIGKILL until thawed."""

    def __init__(self) -> None:
        self.path = os.path.join(FREEZER_ROOT, f"relaunch-test-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        self.pids: list[int] = []

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as file:
            file.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as file:
            return file.read().strip()

    def freeze(self, pid: int) -> None:
        """Move ``pid`` in and freeze it; returns once it is in state D."""
        self._write("cgroup.procs", str(pid))
        self.pids.append(pid)
        self._write("freezer.state", "FROZEN")
        wait_until(lambda: self._read("freezer.state") == "FROZEN", 10, "the cgroup to freeze")
        wait_until(lambda: state_letter(pid) == "D", 10, f"pid {pid} to be in state D")

    def thaw(self) -> None:
        self._write("freezer.state", "THAWED")

    def remove(self) -> None:
        """Thaw, wait for the frozen processes (all killed by now) to leave, remove the cgroup."""
        self.thaw()
        wait_until(lambda: not self._read("cgroup.procs"), 10, "the frozen workers to die")
        os.rmdir(self.path)


class Tracer:
    """A helper process holding a ptrace on one worker; ``release`` ends it (and the trace)."""

    def __init__(self, pid: int) -> None:
        self.proc = subprocess.Popen(
            [PY, "-c", TRACER, str(pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.answer = self.proc.stdout.readline().strip()

    def release(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    """A fresh freezer cgroup, thawed and removed after the test (before the leak check)."""
    try:
        made = Freezer()
    except OSError as error:
        pytest.skip(f"no cgroup v1 freezer to stand in for an unkillable worker: {error}")
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture
def tracers() -> Iterator[list[Tracer]]:
    """The tracers a test starts, released after it (before the leak check)."""
    started: list[Tracer] = []
    yield started
    for tracer in started:
        tracer.release()


def start_two_printing_workers(log_dir: str, leaks: LeakCheck) -> PContext:
    """Two binary workers, their stdout tee'd (a pipe each), both ready and fully logged."""
    args = {rank: ("-c", PRINT_THEN_SLEEP) for rank in range(2)}
    pc = start_processes("w", PY, args, leaks.envs(2), log_dir, tee=Std.OUT)
    for rank in range(2):
        path = pc.stdouts[rank]
        wait_until(lambda p=path: read(p).endswith("ready\n"), 20, f"rank {rank} to be ready")
    return pc


def close_timed(pc: PContext) -> float:
    """Seconds ``close`` takes: SIGTERM, SIGKILL ``GRACE`` s later, then giving up."""
    started = time.monotonic()
    pc.close(signal.SIGTERM, timeout=GRACE)
    return time.monotonic() - started


def warnings_of(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_close_gives_up_on_a_worker_in_uninterruptible_sleep(
    log_dir: str, leaks: LeakCheck, freezer: Freezer, caplog: pytest.LogCaptureFixture, capfd
) -> None:
    pc = start_two_printing_workers(log_dir, leaks)
    stuck_pid = pc.pids()[0]
    freezer.freeze(stuck_pid)

    took = close_timed(pc)

    assert GRACE + KILL_DEADLINE <= took < GRACE + KILL_DEADLINE + SLACK
    (stuck,) = pc.stuck().values()
    assert pc.stuck() == {0: stuck}
    assert (stuck.pid, stuck.state) == (stuck_pid, "D (uninterruptible sleep)")
    warning = f"local rank 0 did not die within {KILL_DEADLINE:g}s of SIGKILL: pid {stuck_pid}"
    assert f"{warning} in state D (uninterruptible sleep)" in warnings_of(caplog)
    result = pc.wait(0)
    assert result is not None and result.stuck == {0: stuck}
    assert result.stopped == {0: -signal.SIGKILL, 1: -signal.SIGTERM}
    for rank in range(2):  # nothing lost, the stuck worker's lines included
        assert read(result.stdouts[rank]) == expected_lines(rank)
    assert not pid_alive(pc.pids()[1])

    freezer.thaw()  # the fatal signals it got while frozen take it now
    status = reap(stuck_pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGTERM, signal.SIGKILL)


def test_close_gives_up_on_a_traced_zombie_without_spinning(
    log_dir: str, leaks: LeakCheck, tracers: list[Tracer], caplog: pytest.LogCaptureFixture, capfd
) -> None:
    pc = start_two_printing_workers(log_dir, leaks)
    stuck_pid = pc.pids()[0]
    tracer = Tracer(stuck_pid)
    tracers.append(tracer)
    if tracer.answer != "attached":
        pc.close(signal.SIGKILL, timeout=0)
        pytest.skip(f"cannot ptrace here to stand in for an unkillable worker: {tracer.answer}")

    cpu_before = time.process_time()
    took = close_timed(pc)
    cpu = time.process_time() - cpu_before

    assert GRACE + KILL_DEADLINE <= took < GRACE + KILL_DEADLINE + SLACK
    # The zombie's pidfd stays ready all along: the monitor must not spin on it.
    assert cpu < 1.0
    assert pc.stuck() == {0: StuckWorker(stuck_pid, "Z (zombie)", "", tracer.proc.pid)}
    assert f"pid {stuck_pid} in state Z (zombie), traced by pid {tracer.proc.pid}" in warnings_of(
        caplog
    )
    result = pc.wait(0)
    assert result is not None and result.stopped == {0: -signal.SIGKILL, 1: -signal.SIGTERM}
    for rank in range(2):
        assert read(result.stdouts[rank]) == expected_lines(rank)

    tracer.release()
    status = reap(stuck_pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


FUNCTION_JOB = """
import os, signal, sys, time
from relaunch import PContext, Std, start_processes

def work():
    print("ready", flush=True)
    time.sleep(300)

if __name__ == "__main__":
    log_dir = sys.argv[1]
    envs = {rank: {"LOCAL_RANK": str(rank)} for rank in range(2)}
    pc = start_processes("fn", work, {0: (), 1: ()}, envs, log_dir, redirects=Std.ALL)
    for path in pc.stdouts.values():
        while not os.path.exists(path) or open(path).read() != "ready\\n":
            time.sleep(0.01)
    print(pc.pids()[0], flush=True)
    sys.stdin.readline()  # the test froze the worker
    started = time.monotonic()
    pc.close(signal.SIGTERM, timeout=%(grace)r)
    print(time.monotonic() - started, sorted(pc.stuck()), flush=True)
    # multiprocessing joins its children at exit: it must not wait for the stuck one.
"""


def test_a_launcher_of_function_workers_exits_despite_a_stuck_one(
    tmp_path, leaks: LeakCheck, freezer: Freezer
) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(FUNCTION_JOB % {"grace": GRACE}))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    with open(tmp_path / "launcher.err", "w") as err:
        launcher = subprocess.Popen(
            [PY, str(job), str(log_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=leaks.process_env(),
        )
    try:
        assert launcher.stdin is not None and launcher.stdout is not None
        stuck_pid = int(launcher.stdout.readline())
        freezer.freeze(stuck_pid)
        started = time.monotonic()
        launcher.stdin.write("go\n")
        launcher.stdin.flush()
        took, stuck = launcher.stdout.readline().split(maxsplit=1)
        returncode = launcher.wait(timeout=GRACE + KILL_DEADLINE + 30)
        exited_after = time.monotonic() - started
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stdin.close()
        launcher.stdout.close()
    err = (tmp_path / "launcher.err").read_text()
    assert returncode == 0, err
    assert float(took) < GRACE + KILL_DEADLINE + SLACK
    assert stuck.strip() == "[0]"
    assert exited_after < GRACE + KILL_DEADLINE + 2 * SLACK
    assert f"pid {stuck_pid} in state D (uninterruptible sleep)" in err
    freezer.thaw()  # its parent is gone: whoever adopted it reaps it
    wait_until(lambda: not pid_alive(stuck_pid), 10, "the thawed worker to die")


CLI_JOB = f"""
import os, sys, time
rank = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
pid_dir, go = sys.argv[1], sys.argv[2]
for i in range({LINES}):
    print(f"rank {{rank}} line {{i}}")
print("ready", flush=True)
if attempt == 0 and rank == 0:
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(300)  # frozen by the test: it outlives its SIGKILL
if attempt == 0 and rank == 1:
    with open(go) as fifo:  # opened for writing once rank 0 is frozen
        fifo.read()
    sys.exit(3)
"""


def open_for_writing(path: str) -> int | None:
    """A write end of the FIFO ``path`` once its reader has opened it, else None."""
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ENXIO:
            return None
        raise


def test_the_agent_restarts_the_group_past_a_worker_that_does_not_die(
    tmp_path, leaks: LeakCheck, freezer: Freezer
) -> None:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(CLI_JOB))
    pid_dir, go, logs = tmp_path / "pids", str(tmp_path / "go"), tmp_path / "logs"
    pid_dir.mkdir()
    os.mkfifo(go)
    argv = ["--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", str(GRACE)]
    argv += ["--tee", "3", "--log-dir", str(logs), str(job), str(pid_dir), go]
    with open(tmp_path / "console.out", "w") as out, open(tmp_path / "console.err", "w") as err:
        launcher = subprocess.Popen(
            [PY, "-m", "relaunch", *argv], stdout=out, stderr=err, env=leaks.process_env()
        )
    try:
        wait_until(lambda: any(pid_dir.iterdir()), 30, "attempt 0's rank 0 to start")
        (name,) = os.listdir(pid_dir)
        stuck_pid = int(name)
        freezer.freeze(stuck_pid)
        fds: list[int] = []
        wait_until(lambda: fds.append(open_for_writing(go) or -1) or fds[-1] >= 0, 30, "rank 1")
        started = time.monotonic()
        os.close(fds[-1])  # rank 1 fails now: the group stops, rank 0 will not die
        returncode = launcher.wait(timeout=GRACE + KILL_DEADLINE + 40)
        ended_after = time.monotonic() - started
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    stderr = (tmp_path / "console.err").read_text()
    assert returncode == 0, stderr
    assert f"pid {stuck_pid} in state D (uninterruptible sleep)" in stderr
    assert "restarting the worker group" in stderr
    # The whole restart (stop, give up, start again, run attempt 1) took about the deadline.
    assert ended_after < GRACE + KILL_DEADLINE + 4 * SLACK
    (run_dir,) = logs.iterdir()
    for attempt in (0, 1):
        for rank in (0, 1):
            path = run_dir / f"attempt_{attempt}" / str(rank) / "stdout.log"
            assert path.read_text() == expected_lines(rank), (attempt, rank)
    freezer.thaw()  # its parent, the launcher, is gone: whoever adopted it reaps it
    wait_until(lambda: not pid_alive(stuck_pid), 10, "the thawed worker to die")
