"""Spare nodes, health checks and exclusion, with real agents on a real store: the built-in one
(hosted by the first agent) and a real etcd member (the ``rdzv`` fixture runs each test on
both).

Each agent writes its stdout and stderr to files, which the tests read while it runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until
from test_rendezvous import FAST, FORM_TWO, Rendezvous, lines, rendezvous_for, script

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["c10d", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> Rendezvous:
    return rendezvous_for(request)


#: Workers print their world, then wait for the test's GO file (a job that runs until told). A
#: worker in a world of two leaves a mark; one told to FAIL fails once the healthy node's worker
#: of its world has printed (its mark is there), so every world of two is on both consoles.
WORLD_UNTIL_GO = """
    import glob, os, sys, time
    print("world", os.environ["WORLD_SIZE"], "rank", os.environ["RANK"], flush=True)
    marks = os.environ["GO_FILE"] + ".two."
    if os.environ.get("FAIL") == "1":
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        deadline = time.monotonic() + 20
        while len(glob.glob(marks + "*")) <= attempt and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit("this node's worker fails")
    if os.environ["WORLD_SIZE"] == "2":
        open(marks + str(os.getpid()), "w").close()
    while not os.path.exists(os.environ["GO_FILE"]):
        time.sleep(0.01)
"""


@dataclass
class Node:
    """One agent, its output in files."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def stdout(self) -> list[str]:
        return lines(self.out.read_text())

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float = 60) -> int:
        """The agent's exit status; an ``AssertionError`` with what it said when it has not
        ended within ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the agent did not end within {timeout:g}s; its stderr:\n{self.stderr()}"
            ) from None


def start(
    tmp_path: Path,
    leaks: LeakCheck,
    rdzv: Rendezvous,
    name: str,
    job: str,
    *flags: str,
    env: dict[str, str] | None = None,
) -> Node:
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relaunch",
                "--rdzv-backend",
                rdzv.backend,
                "--rdzv-endpoint",
                rdzv.endpoint,
                "--rdzv-id",
                rdzv.run_id,
                "--tee",
                "1",
                *flags,
                job,
            ],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=leaks.process_env(GO_FILE=str(tmp_path / "go"), **(env or {})),
        )
    return Node(proc, out, err)


def stop_all(nodes: list[Node]) -> None:
    """Kill (by pid) the agents a failed test left running."""
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.kill()
        node.proc.wait()


def test_a_spare_takes_the_place_of_a_killed_member(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(tmp_path, WORLD_UNTIL_GO)
    flags = ("--nnodes", "2:2", "--rdzv-conf", FAST)
    nodes = [start(tmp_path, leaks, rdzv, "first", job, *flags)]
    try:
        wait_until(rdzv.ready, what="the first agent to host the store")
        nodes.append(start(tmp_path, leaks, rdzv, "second", job, *flags))
        first, second = nodes
        wait_until(lambda: len(first.stdout()) == 1 and len(second.stdout()) == 1, 60, "world 2")
        spare = start(tmp_path, leaks, rdzv, "spare", job, *flags)
        nodes.append(spare)
        wait_until(lambda: "waiting as a spare" in spare.stderr(), 60, "the spare to wait")
        assert spare.stdout() == []
        second.proc.send_signal(signal.SIGKILL)  # not the first: on c10d it hosts the store
        second.wait()
        wait_until(lambda: len(spare.stdout()) == 1, 60, "the spare's worker")
        wait_until(lambda: len(first.stdout()) == 2, 60, "the first node's worker again")
        (tmp_path / "go").touch()
        assert (first.wait(), spare.wait()) == (0, 0), first.stderr() + spare.stderr()
    finally:
        stop_all(nodes)
    new_world = sorted([first.stdout()[1], *spare.stdout()])
    assert new_world == ["world 2 rank 0", "world 2 rank 1"], "the spare took the lost place"
    assert "lost" in first.stderr() and "0 restart(s) left" in first.stderr()
    assert "job" in spare.stderr() and "is full (2 of at most 2 nodes)" in spare.stderr()


def test_a_spare_waits_past_join_timeout_and_exits_cleanly_when_the_job_ends(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(tmp_path, WORLD_UNTIL_GO)
    conf = FAST.replace("join_timeout=20", "join_timeout=1")
    flags = ("--nnodes", "1:1", "--rdzv-conf", conf)
    nodes = [start(tmp_path, leaks, rdzv, "member", job, *flags)]
    try:
        member = nodes[0]
        wait_until(lambda: len(member.stdout()) == 1, 60, "the member's worker")
        spare = start(tmp_path, leaks, rdzv, "spare", job, *flags)
        nodes.append(spare)
        wait_until(lambda: "waiting as a spare" in spare.stderr(), 60, "the spare to wait")
        with pytest.raises(subprocess.TimeoutExpired):
            spare.proc.wait(timeout=3)  # three times its join_timeout: it still waits
        (tmp_path / "go").touch()
        assert member.wait() == 0, member.stderr()
        assert spare.wait() == 0, spare.stderr()
    finally:
        stop_all(nodes)
    assert spare.stdout() == []
    assert "has already finished" in spare.stderr() and "Traceback" not in spare.stderr()


def test_a_node_that_fails_the_job_repeatedly_is_excluded_and_the_others_go_on(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(tmp_path, WORLD_UNTIL_GO)
    conf = FORM_TWO + ",exclude_after=2,exclude_cooldown=600"
    flags = ("--nnodes", "1:2", "--max-restarts", "5")
    nodes = [
        start(tmp_path, leaks, rdzv, "good", job, *flags, "--rdzv-conf", conf + ",node_name=a")
    ]
    try:
        wait_until(rdzv.ready, what="the first agent to host the store")
        bad = start(
            tmp_path,
            leaks,
            rdzv,
            "bad",
            job,
            *flags,
            "--rdzv-conf",
            conf + ",node_name=b",
            env={"FAIL": "1"},
        )
        nodes.append(bad)
        good = nodes[0]
        wait_until(lambda: "excluded from the job until" in bad.stderr(), 90, "the exclusion")
        wait_until(lambda: good.stdout()[-1:] == ["world 1 rank 0"], 60, "the other goes on")
        (tmp_path / "go").touch()
        assert good.wait() == 0, good.stderr()
        assert bad.wait() == 1, bad.stderr()  # its own failure stands
    finally:
        stop_all(nodes)
    worlds = [line.split()[1] for line in good.stdout()]
    # (On a loaded machine the first node may have started alone, before the second came.)
    assert worlds[-3:] == ["2", "2", "1"] and set(worlds[:-3]) <= {"1"}, worlds
    assert "restarting the worker group (node " in good.stderr()  # re-formed without it
    assert [line.split()[1] for line in bad.stdout()] == ["2", "2"]
    host = os.uname().nodename
    assert f"node {host}/b (group rank" in good.stderr() and "is excluded until" in good.stderr()
    assert "it will try to join again then" in bad.stderr()


def test_a_failing_health_check_keeps_the_node_out_until_it_passes(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    job = script(tmp_path, "import os; print('world', os.environ['WORLD_SIZE'])\n")
    ok, seen = tmp_path / "healthy", tmp_path / "seen"
    check = (
        f'echo "$LOCAL_WORLD_SIZE $TORCHELASTIC_RUN_ID" > {seen}; '
        f"test -e {ok} || {{ echo starting; echo 'gpu 0: not found'; exit 3; }}"
    )
    standalone = Rendezvous("c10d", "127.0.0.1:0", lambda: True, "health-job")
    node = start(
        tmp_path,
        leaks,
        standalone,
        "node",
        job,
        "--nproc-per-node",
        "2",
        "--health-check",
        check,
        "--health-check-cooldown",
        "0.2",
    )
    try:
        failed = "health check failed (exit 3: 'gpu 0: not found'): "
        wait_until(lambda: node.stderr().count(failed) >= 2, 60, "two failed checks")
        assert node.stdout() == [], "an unhealthy node does not start its workers"
        ok.touch()
        assert node.wait() == 0, node.stderr()
    finally:
        stop_all([node])
    assert node.stdout() == ["world 2", "world 2"]
    assert f"{failed}{check}; not joining, trying again in 0.2s" in node.stderr()
    assert seen.read_text().split() == ["2", "health-job"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--health-check", "  "),
        ("--health-check-cooldown", "-1"),
        ("--health-check-timeout", "0"),
        ("--rdzv-conf", "exclude_after=-1"),
        ("--rdzv-conf", "node_name=a/b"),
    ],
)
def test_bad_values_are_one_line_usage_errors(
    tmp_path: Path, leaks: LeakCheck, flag: str, value: str
) -> None:
    job = script(tmp_path, "pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "relaunch", "--rdzv-backend", "c10d", flag, value, job],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=60,
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
