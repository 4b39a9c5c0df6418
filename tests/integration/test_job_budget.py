"""The job's restart budget, the genuine last failure reported at once, and the bounded exit
barrier: real agents (``python -m relaunch``) on the built-in store and on a real etcd member.

- The restart budget is the job's: every node's failures spend it, a node joining does not.
- With no restart left, a failure that every other node answers a presence check for ends the job on
  every node at once; one a dead node caused still re-forms the group, for free.
- ``--exit-barrier-timeout`` bounds how long a finished node waits for the others.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from typing import IO

import pytest
import test_rendezvous
from conftest import LeakCheck, wait_until
from test_rendezvous import FAST, FORM_TWO, WAITING, Rendezvous, lines, script

pytestmark = pytest.mark.timeout(120)

#: Every test runs on the built-in store (hosted by the first agent) and on a real etcd member.
rdzv = test_rendezvous.rdzv

#: The lost-node grace of the default rendezvous timings (keep-alive 5 s, 3 attempts): what a
#: genuine last failure used to wait before it was reported.
DEFAULT_GRACE = 20.0


class Node:
    """One agent of the test's job: its output read line by line as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self.exited_at: float | None = None
        self._readers = [
            threading.Thread(target=self._read, args=(stream, into), daemon=True)
            for stream, into in ((proc.stdout, self.out), (proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()
        threading.Thread(target=self._reap, daemon=True).start()

    @staticmethod
    def _read(stream: IO[str] | None, into: list[str]) -> None:
        assert stream is not None
        for line in stream:
            into.append(line.rstrip("\n"))

    def _reap(self) -> None:
        self.proc.wait()
        self.exited_at = time.monotonic()

    def printed(self) -> list[str]:
        """What its workers printed (the ``--tee 1`` lines, without their prefix)."""
        return lines("\n".join(self.out))

    def said(self) -> str:
        return "\n".join(self.err)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return code


def start(rendezvous: Rendezvous, leaks: LeakCheck, job: str, *flags: str, **env: str) -> Node:
    """An agent of the test's job; ``env`` reaches its workers."""
    return Node(rendezvous.agent(leaks, job, *flags, env=env))


def start_pair(
    rendezvous: Rendezvous,
    leaks: LeakCheck,
    job: str,
    *flags: str,
    envs: tuple[dict[str, str], ...],
) -> list[Node]:
    """Two agents of one job, the first up (hosting the store on c10d) before the second."""
    first = start(rendezvous, leaks, job, *flags, **envs[0])
    wait_until(rendezvous.ready, what="the first agent to host the store")
    return [first, start(rendezvous, leaks, job, *flags, **envs[1])]


def start_world_of_two(
    rendezvous: Rendezvous,
    leaks: LeakCheck,
    job: str,
    *flags: str,
    envs: tuple[dict[str, str], dict[str, str]],
) -> list[Node]:
    """Two agents of a job that may run on one, forming one world of 2 (``Rendezvous.pair``):
    the host (c10d: of the store) and the other, started first; their ``envs`` in that order."""
    other = Node(rendezvous.pair_other(leaks, job, *flags, env=envs[1]))
    try:
        wait_until(
            lambda: WAITING in other.said() or other.proc.poll() is not None,
            60,
            "the other agent to wait",
        )
        assert other.proc.poll() is None, f"the other agent ended before it waited:\n{other.said()}"
        return [Node(rendezvous.pair_host(leaks, job, *flags, env=envs[0])), other]
    except BaseException:
        stop_all([other])
        raise


def stop_all(nodes: list[Node]) -> None:
    """Kill (by pid) the agents a failed test left running; their workers die with them."""
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(30)


# -- item 4: the job's restart budget ----------------------------------------------------------

#: Workers leave a mark per attempt, so a failing one can wait until its peer has started.
MARKS = """
    import os, sys, time
    def mark(tag):
        open(os.path.join(os.environ["MARKS"], tag), "w").close()
    def await_mark(tag):
        while not os.path.exists(os.path.join(os.environ["MARKS"], tag)):
            time.sleep(0.01)
"""

TAKE_TURNS = (
    MARKS
    + """
    attempt, node = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), os.environ["NODE"]
    print("attempt", attempt, node, flush=True)
    mark(f"{node}.{attempt}")
    if str(attempt) in os.environ["FAIL_ON"].split(","):
        await_mark(f"{'b' if node == 'a' else 'a'}.{attempt}")
        sys.exit(f"node {node} fails attempt {attempt}")
    time.sleep(100)  # until the other node's failure restarts the group
"""
)


def test_restarts_caused_by_different_nodes_exhaust_the_jobs_budget_for_all(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """Node a fails attempts 0 and 2, node b attempts 1 and 3: three group restarts spend
    ``--max-restarts 3`` (counted per agent, each would have had one or two left), so b's
    second failure ends the job on both nodes."""
    job = script(tmp_path, TAKE_TURNS)
    marks = {"MARKS": str(tmp_path)}
    nodes = start_pair(
        rdzv,
        leaks,
        job,
        "--nnodes",
        "2",
        "--max-restarts",
        "3",
        "--rdzv-conf",
        FAST,
        envs=({"NODE": "a", "FAIL_ON": "0,2", **marks}, {"NODE": "b", "FAIL_ON": "1,3", **marks}),
    )
    try:
        codes = [node.wait(90) for node in nodes]
    finally:
        stop_all(nodes)
    a, b = nodes
    for node in nodes:
        attempts = [int(line.split()[1]) for line in node.printed()]
        assert attempts == [0, 1, 2, 3], node.said()
    assert codes == [1, 1], a.said() + "\n---\n" + b.said()
    assert "node b fails attempt 3" in b.said() and "Root cause" in b.said()
    assert "the job failed" in a.said() and "(no restart left)" in a.said()
    restarts = [line for line in a.said().splitlines() if "restarting the worker group" in line]
    assert len(restarts) == 3, a.said()
    assert "Traceback" not in a.said() + b.said()


SLOW_TO_STOP = (
    MARKS
    + """
    import signal
    node, local = os.environ["NODE"], os.environ["LOCAL_RANK"]
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        sys.exit(0)
    def stopped(*_):
        with open(os.path.join(os.environ["MARKS"], f"term.{node}.{local}"), "w") as file:
            file.write(repr(time.time()))
        if (node, local) == ("a", "1"):
            time.sleep(3)  # slow to stop: its node's group ends 3 s after the failure
        os._exit(143)
    signal.signal(signal.SIGTERM, stopped)
    mark(f"up.{node}.{local}")
    for other in ("a.0", "a.1", "b.0", "b.1"):
        await_mark(f"up.{other}")
    if (node, local) == ("a", "0"):
        mark("failed")
        sys.exit("a genuine error")
    time.sleep(100)  # until the failure stops it
"""
)


def test_the_other_nodes_stop_their_workers_as_a_failure_is_seen_not_after_its_node_stopped(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """A rank of node a fails while its sibling takes 3 s to stop: node b is told at once
    (its workers are stopped meanwhile), not once node a's workers are all gone; the group
    restarts once, spending one restart."""
    job = script(tmp_path, SLOW_TO_STOP)
    marks = {"MARKS": str(tmp_path)}
    nodes = start_pair(
        rdzv,
        leaks,
        job,
        *("--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1"),
        *("--rdzv-conf", FORM_TWO),
        envs=({"NODE": "a", **marks}, {"NODE": "b", **marks}),
    )
    try:
        codes = [node.wait(90) for node in nodes]
    finally:
        stop_all(nodes)
    a, b = nodes
    assert codes == [0, 0], a.said() + "\n---\n" + b.said()
    slow = float((tmp_path / "term.a.1").read_text())
    told = [float((tmp_path / f"term.b.{local}").read_text()) for local in (0, 1)]
    assert max(told) < slow + 2.0, (told, slow)  # b stopped before a's slow rank was gone
    assert "a genuine error" in b.said()  # the reason it was told
    restarts = [line for line in a.said().splitlines() if "restarting the worker group" in line]
    assert len(restarts) == 1, a.said()


GROW_THEN_FAIL_ONCE = (
    MARKS
    + """
    world, attempt = os.environ["WORLD_SIZE"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print("world", world, "attempt", attempt, flush=True)
    mark(f"{world}.{attempt}.{os.environ['GROUP_RANK']}")
    if world == "1":
        time.sleep(100)  # until the second node joins
    elif attempt == "0" and os.environ["GROUP_RANK"] == "1":
        await_mark("2.0.0")
        sys.exit("fails once")
    elif attempt == "0":
        time.sleep(100)  # until its peer's failure restarts the group
"""
)


def test_a_node_joining_does_not_spend_the_budget(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """One restart allowed: the growth from one node to two is free, so the failure after it
    still has its restart, and the job succeeds."""
    job = script(tmp_path, GROW_THEN_FAIL_ONCE)
    flags = ("--nnodes", "1:2", "--max-restarts", "1", "--rdzv-conf", FAST)
    first = start(rdzv, leaks, job, *flags, MARKS=str(tmp_path))
    nodes = [first]
    try:
        wait_until(lambda: first.printed() == ["world 1 attempt 0"], 60, "the first world")
        nodes.append(start(rdzv, leaks, job, *flags, MARKS=str(tmp_path)))
        codes = [node.wait(90) for node in nodes]
    finally:
        stop_all(nodes)
    assert codes == [0, 0], first.said() + "\n---\n" + nodes[1].said()
    assert first.printed() == ["world 1 attempt 0", "world 2 attempt 0", "world 2 attempt 1"]
    assert nodes[1].printed() == ["world 2 attempt 0", "world 2 attempt 1"]


# -- item 5: a genuine last failure at once; one a dead node caused re-forms --------------------

FAIL_ON_GO = """
    import os, sys, time
    print("world", os.environ["WORLD_SIZE"], "node", os.environ["NODE"], os.getpid(), flush=True)
    while not os.path.exists(os.environ["GO_FILE"]):  # the test says when
        time.sleep(0.01)
    if os.environ["NODE"] == "b":
        with open(os.environ["STAMP"], "w") as stamp:
            stamp.write(repr(time.monotonic()))
        raise SystemExit("a genuine error")
    time.sleep(100)  # the healthy node: stopped by the job's end
"""


def test_a_genuine_last_failure_ends_every_node_at_once(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """Default rendezvous timings: before the presence check, the failing node waited the lost-node
    grace (20 s) and the healthy one then waited for a second node that never came."""
    job = script(tmp_path, FAIL_ON_GO)
    go, stamp = tmp_path / "go", tmp_path / "stamp"
    common = {"GO_FILE": str(go), "STAMP": str(stamp)}
    nodes = start_pair(
        rdzv,
        leaks,
        job,
        "--nnodes",
        "2",
        "--max-restarts",
        "0",
        envs=({"NODE": "a", **common}, {"NODE": "b", **common}),
    )
    try:
        wait_until(lambda: all(node.printed() for node in nodes), 60, "both workers to start")
        go.touch()
        codes = [node.wait(60) for node in nodes]
    finally:
        stop_all(nodes)
    a, b = nodes
    failed_at = float(stamp.read_text())
    took = [node.exited_at - failed_at for node in nodes if node.exited_at is not None]
    assert codes == [1, 1], a.said() + "\n---\n" + b.said()
    assert len(took) == 2 and max(took) < 5.0 < DEFAULT_GRACE, took
    assert "a genuine error" in b.said() and "Root cause" in b.said()
    assert "the job failed" in a.said() and "workers were stopped before they finished" in a.said()
    assert "waiting up to" not in a.said() + b.said()  # no grace was waited


BREAK_WHEN_THE_PEER_DIES = """
    import os, sys, time
    print("world", os.environ["WORLD_SIZE"], os.getpid(), flush=True)
    if os.environ["WORLD_SIZE"] == "2":
        while not os.path.exists(os.environ["BROKEN"]):  # the collective, until its peer dies
            time.sleep(0.01)
        sys.exit("the collective broke: peer gone")
"""


def test_a_last_failure_caused_by_a_killed_node_still_re_forms(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """The dead node cannot answer the presence check: the survivor waits for its loss to be
    noticed and re-forms without it, for free, though no restart was left."""
    broken = tmp_path / "broken"
    job = script(tmp_path, BREAK_WHEN_THE_PEER_DIES)
    env = {"BROKEN": str(broken)}
    flags = ("--nnodes", "1:2", "--max-restarts", "0")
    survivor, victim = start_world_of_two(rdzv, leaks, job, *flags, envs=(env, env))
    try:
        wait_until(lambda: survivor.printed() and victim.printed(), 60, "the world of two")
        (worker,) = [int(line.split()[2]) for line in victim.printed()]
        os.kill(victim.proc.pid, signal.SIGKILL)  # the whole node: its agent and its workers
        os.kill(worker, signal.SIGKILL)
        victim.wait(30)
        wait_until(lambda: not _alive(worker), 30, "the killed worker to be gone")
        broken.touch()
        killed_at = time.monotonic()
        code = survivor.wait(60)
    finally:
        stop_all([survivor, victim])
    assert code == 0, survivor.said()
    assert [line.split()[1] for line in survivor.printed()] == ["2", "1"]
    assert "lost" in survivor.said() and "the job failed" not in survivor.said()
    assert survivor.exited_at is not None
    print(f"re-formed and finished {survivor.exited_at - killed_at:.1f}s after the failure")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not re.search(r"^State:\s+Z", open(f"/proc/{pid}/status").read(), re.M)


# -- item 6: the exit barrier is bounded -------------------------------------------------------

ONE_NODE_NEVER_FINISHES = """
    import os, time
    print("node", os.environ["NODE"], flush=True)
    if os.environ["NODE"] == "slow":
        time.sleep(100)
    with open(os.environ["STAMP"], "w") as stamp:
        stamp.write(repr(time.monotonic()))
"""


def test_the_exit_barrier_ends_after_its_timeout(
    tmp_path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """The quick node passes the barrier after ``--exit-barrier-timeout`` (not 300 s) and ends
    the job; the slow node's workers are cut short, which it reports as a failure."""
    job = script(tmp_path, ONE_NODE_NEVER_FINISHES)
    stamp = tmp_path / "stamp"
    flags = ("--nnodes", "2", "--exit-barrier-timeout", "2", "--rdzv-conf", FAST)
    envs = ({"NODE": "slow", "STAMP": str(stamp)}, {"NODE": "quick", "STAMP": str(stamp)})
    slow, quick = start_pair(rdzv, leaks, job, *flags, envs=envs)
    try:
        codes = [slow.wait(60), quick.wait(10)]
    finally:
        stop_all([slow, quick])
    assert codes[1] == 0, quick.said()
    assert quick.exited_at is not None and slow.exited_at is not None
    finished_at = float(stamp.read_text())  # the quick worker's end: the barrier came after
    assert 2.0 <= quick.exited_at - finished_at < 15.0, quick.said()
    assert codes[0] == 1 and "Traceback" not in slow.said(), slow.said()
    assert "workers were stopped before they finished" in slow.said(), slow.said()
    assert slow.exited_at - quick.exited_at < 15.0
