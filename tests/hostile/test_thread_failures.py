"""No helper thread dies silently (issue 24, item 3): a value in the rendezvous store that no
relaunch wrote, or an exception in one of the agent's threads, ends the job on every node with
one line naming the key or the cause, exit 1, no traceback, and no process left.

Two real agents each time; the bad value is written into the real store (the built-in store the
first agent hosts, or a real etcd member) with relaunch's own store clients while they run. An
exception is injected into a real agent by starting it through a wrapper that patches one
method of the thread under test to raise once the test says so (a flag file).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO

import pytest
from conftest import LeakCheck, wait_until

from relaunch.endpoints import find_free_port
from relaunch.store.client import TcpStore

pytestmark = pytest.mark.timeout(60)

FAST = "keep_alive_interval=0.3,keep_alive_max_attempt=3,last_call_timeout=3,join_timeout=20"
#: How long both agents may take to end once the fault is in place.
END_WITHIN = 15.0

#: Each worker says it is up, then ticks (so the worker monitor has output to move) until the
#: file FAIL_WHEN exists, if given, when it fails.
JOB = textwrap.dedent(
    """
    import os, sys, time
    print("up", flush=True)
    fail_when = os.environ.get("FAIL_WHEN")
    for _ in range(600):
        if fail_when and os.path.exists(fail_when):
            sys.exit(3)
        print("tick", flush=True)
        time.sleep(0.1)
    """
)

#: Runs the relaunch CLI with ``INJECT_TARGET`` (module:Class.method) raising RuntimeError once
#: the file ``INJECT_WHEN`` exists: an exception in a real agent's thread, nothing else changed.
WRAPPER = textwrap.dedent(
    """
    import importlib, os, sys
    module, attribute = os.environ["INJECT_TARGET"].split(":")
    owner_name, method = attribute.split(".")
    owner = getattr(importlib.import_module(module), owner_name)
    original = getattr(owner, method)
    def injected(*args, **kwargs):
        if os.path.exists(os.environ["INJECT_WHEN"]):
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)
    setattr(owner, method, injected)
    from relaunch.cli.command import console_main
    sys.argv[0] = "relaunch"
    console_main()
    """
)


class Agent:
    """One relaunch agent: its stderr collected as it comes, its end time noted."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=_read, args=(stream, into), daemon=True)
            for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    def said(self) -> str:
        return "\n".join(self.err)

    def up(self) -> bool:
        return any(line.endswith("up") for line in self.out)

    def end(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(5)
        return code


def _read(stream: IO[str] | None, into: list[str]) -> None:
    assert stream is not None
    for line in stream:
        into.append(line.rstrip("\n"))


class Job:
    """Two agents of one job on ``backend`` (c10d: the first hosts the store)."""

    def __init__(self, tmp_path, leaks: LeakCheck, backend: str, etcd_endpoints: str = "") -> None:
        self.tmp_path, self.leaks, self.backend = tmp_path, leaks, backend
        self.run_id = uuid.uuid4().hex[:12]
        if backend == "c10d":
            self.port = find_free_port("127.0.0.1")
            self.endpoint = f"127.0.0.1:{self.port}"
        else:
            self.endpoint = etcd_endpoints
        self.job = tmp_path / "job.py"
        self.job.write_text(JOB)
        self.agents: list[Agent] = []

    def start(self, inject: str = "", **env: str) -> Agent:
        args = [
            "--rdzv-backend",
            self.backend,
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.run_id,
            "--nnodes",
            "2",
            "--max-restarts",
            "3",
            "--rdzv-conf",
            FAST,
            "--tee",
            "1",
            str(self.job),
        ]
        if inject:
            wrapper = self.tmp_path / "wrapper.py"
            wrapper.write_text(WRAPPER)
            argv = [sys.executable, str(wrapper), *args]
            env = {**env, "INJECT_TARGET": inject, "INJECT_WHEN": str(self.tmp_path / "inject")}
        else:
            argv = [sys.executable, "-m", "relaunch", *args]
        agent = Agent(argv, self.leaks.process_env(**env))
        self.agents.append(agent)
        return agent

    def start_both(self, first: dict[str, str], second: dict[str, str]) -> None:
        """Both agents, their workers up (the first hosts the store on c10d)."""
        self.start(**first)
        if self.backend == "c10d":
            wait_until(self._serving, what="the first agent to host the store")
        self.start(**second)
        wait_until(lambda: all(agent.up() for agent in self.agents), 30, "both workers up")

    def _serving(self) -> bool:
        try:
            TcpStore("127.0.0.1", self.port, timeout=1, connect_timeout=0.1).close()
        except Exception:
            return False
        return True

    def write(self, key: str, value: bytes) -> None:
        """Write ``value`` under the job's ``key`` in the real store, as a stranger would."""
        full = f"relaunch/{self.run_id}/{key}"
        if self.backend == "c10d":
            with TcpStore("127.0.0.1", self.port, timeout=5) as store:
                store.set(full, value)
        else:
            from relaunch.store.etcd import EtcdStore

            store = EtcdStore(self.endpoint, timeout=5)
            try:
                store.set(full, value)
            finally:
                store.close()

    def ends_in_one_line(self, names: str, within: float = END_WITHIN) -> None:
        """Both agents exit 1 within ``within`` seconds, each with one line naming ``names``
        and no traceback."""
        began = time.monotonic()
        codes: list[int | None] = []
        try:
            for agent in self.agents:
                try:
                    codes.append(agent.end(max(1.0, within - (time.monotonic() - began))))
                except subprocess.TimeoutExpired:
                    codes.append(None)  # still running: reported with what both said
        finally:
            for agent in self.agents:
                if agent.proc.poll() is None:
                    agent.proc.kill()
                    agent.proc.wait(10)
                for reader in agent.readers:
                    reader.join(5)
        said = [agent.said() for agent in self.agents]
        for number, (code, text) in enumerate(zip(codes, said, strict=True)):
            # Shown in full with a failure (an assertion's message is cut short).
            ended = "not ended" if code is None else f"exit {code}"
            print(f"--- agent {number} ({ended} within {within}s), its stderr:\n{text}")
        assert codes == [1, 1], said
        for text in said:
            assert "Traceback" not in text, text
            naming = [line for line in text.splitlines() if names in line]
            assert len(naming) == 1, text
            assert naming[0].startswith("relaunch: error: "), text


@pytest.fixture(params=["c10d", "etcd"])
def job(request: pytest.FixtureRequest, tmp_path, leaks: LeakCheck) -> Job:
    if request.param == "etcd":
        return Job(tmp_path, leaks, "etcd", request.getfixturevalue("etcd_shared").endpoints)
    return Job(tmp_path, leaks, "c10d")


def test_a_bad_change_record_ends_the_job_on_both_nodes(job: Job) -> None:
    """Before: the membership watchers of both agents died with a JSONDecodeError traceback and
    the job went on blind."""
    job.start_both({}, {})
    job.write("news/r0/changed", b"{not json")
    job.write("news/r0/bell", b"{not json")
    job.ends_in_one_line(f"bad value under relaunch/{job.run_id}/news/r0/")


def test_a_bad_restart_count_ends_the_job_on_both_nodes(tmp_path, leaks: LeakCheck) -> None:
    """Before: the agent whose worker failed read ``restarts`` = ``abc``, died with a ValueError
    traceback, and left its peer waiting for join_timeout."""
    job = Job(tmp_path, leaks, "c10d")
    fail = str(tmp_path / "fail")
    job.start_both({}, {"FAIL_WHEN": fail})
    job.write("restarts", b"abc")
    open(fail, "w").close()  # the second node's worker fails: its agent reads the count
    job.ends_in_one_line(f"bad value under relaunch/{job.run_id}/restarts ('abc')")


#: A method of each helper thread that runs while the job does, by thread.
THREADS = {
    "relaunch-monitor": "relaunch.procs.monitor:GroupMonitor._flush_consoles",
    "relaunch-heartbeat": "relaunch.rendezvous.kinds_counter:CounterPulse.beat",
    "relaunch-status": "relaunch.agent.status:NodeReporter.report",
}


@pytest.mark.parametrize("thread", sorted(THREADS))
def test_a_thread_that_fails_ends_the_job_on_both_nodes(
    thread: str, tmp_path, leaks: LeakCheck
) -> None:
    """An exception in a helper thread of one agent (injected) ends that agent with one line
    naming the thread, and the job on the other node too."""
    job = Job(tmp_path, leaks, "c10d")
    job.start_both({"inject": THREADS[thread]}, {})
    open(tmp_path / "inject", "w").close()
    job.ends_in_one_line(f"relaunch's {thread} thread failed: RuntimeError: injected fault")


@pytest.mark.parametrize("moment", ["as the workers start", "as a worker exits"])
def test_a_worker_monitor_that_fails_at_any_moment_ends_the_job(
    moment: str, tmp_path, leaks: LeakCheck
) -> None:
    """The worker monitor fails as its first output is copied, or as it records a worker's
    exit (running, it is ``test_a_thread_that_fails_ends_the_job_on_both_nodes``). Before: it
    killed the workers and ended their group as all "stopped", none failed; the agent, woken by
    that end before the monitor's failure was reported, took it for a success and waited in the
    exit barrier, its peer for it (reproduced 3 runs in 8 under two busy loops)."""
    job = Job(tmp_path, leaks, "c10d")
    open(tmp_path / "inject", "w").close()  # from the start
    if moment == "as the workers start":
        job.start(inject="relaunch.procs.monitor:GroupMonitor._flush_consoles")
        wait_until(job._serving, what="the first agent to host the store")
        job.start()
    else:
        fail = str(tmp_path / "fail")
        job.start_both(
            {"inject": "relaunch.procs.monitor:GroupMonitor._record_exit", "FAIL_WHEN": fail}, {}
        )
        open(fail, "w").close()  # the first node's worker exits: its monitor records it
    job.ends_in_one_line("relaunch's relaunch-monitor thread failed: RuntimeError: injected fault")


def test_start_thread_reports_a_failure_rather_than_printing_a_traceback(capfd) -> None:
    from relaunch import runtime

    woken = threading.Event()
    watch = runtime.THREAD_FAILURES.watch(woken.set)
    try:
        boom: Callable[[], None] = lambda: 1 / 0  # noqa: E731
        runtime.start_thread(boom, "relaunch-test").join(5)
        assert woken.is_set()
        with pytest.raises(runtime.ThreadFailed, match="relaunch-test thread failed: Zero"):
            watch.check()
    finally:
        watch.close()
    assert "Traceback" not in capfd.readouterr().err
