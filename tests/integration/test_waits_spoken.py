"""Every wait for nodes is spoken, and ``relaunch status`` never shows a dead node healthy: real
agents of ``--nnodes 2`` on a real store (the built-in one, hosted by the first agent, and a real
etcd member), one SIGKILLed and replaced.

``RELAUNCH_WAIT_NOTICE=0.5``: a waiting agent says so after half a second, then every 1.5 s (by
default after 20 s, then every minute). The pure lines: tests/unit/test_wait_lines.py.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from conftest import LeakCheck, relaunch_cli, wait_until
from test_rendezvous import FAST, Rendezvous, rendezvous_for, script
from test_spares_and_health import WORLD_UNTIL_GO, Node, start, stop_all

pytestmark = pytest.mark.timeout(120)

NOTICE = {"RELAUNCH_WAIT_NOTICE": "0.5"}


@pytest.fixture(params=["c10d", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> Rendezvous:
    return rendezvous_for(request)


def waits(node: Node) -> list[str]:
    """The lines ``node`` said it waits for one more node with."""
    return [line for line in node.stderr().splitlines() if "waiting for 1 more node" in line]


def status(leaks: LeakCheck, rdzv: Rendezvous) -> str:
    """``relaunch status`` of the job, as printed."""
    shown = relaunch_cli(
        leaks,
        "status",
        *("--rdzv-backend", rdzv.backend, "--rdzv-endpoint", rdzv.endpoint),
        *("--rdzv-id", rdzv.run_id),
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_waits_are_spoken_and_a_killed_node_is_shown_lost_then_replaced(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(tmp_path, WORLD_UNTIL_GO)
    flags = ("--nnodes", "2", "--rdzv-conf", FAST)
    nodes = [start(tmp_path, leaks, rdzv, "first", job, *flags, env=NOTICE)]
    first = nodes[0]
    try:
        # Alone: it says what it waits for, how many of how many, where and until when; again.
        wait_until(lambda: len(waits(first)) >= 2, 30, "the lone agent to say twice it waits")
        said = waits(first)[0]
        where = f" at {rdzv.endpoint}" if rdzv.backend == "c10d" else " at "
        assert f"(1 of 2 joined, job {rdzv.run_id!r}{where}" in said, said
        assert re.search(r"\); giving up in 1\ds$", said), said  # join_timeout=20
        assert "round 0 forming (1 of 2 joined)" in status(leaks, rdzv)

        second = start(tmp_path, leaks, rdzv, "second", job, *flags, env=NOTICE)
        nodes.append(second)
        wait_until(lambda: len(first.stdout()) == 1 and len(second.stdout()) == 1, 60, "world 2")
        before_kill = len(waits(first))
        second.proc.send_signal(signal.SIGKILL)  # not the first: on c10d it hosts the store
        second.wait()

        # The survivor re-forms and says what it waits for; status shows the dead node lost.
        wait_until(lambda: len(waits(first)) > before_kill, 30, "the survivor to say it waits")
        shown = status(leaks, rdzv)
        assert "round 1: 1 of 2 joined" in shown, shown
        (lost,) = [line for line in shown.splitlines() if "LOST" in line]
        assert "HEALTHY" not in lost and re.search(r"\s1\s+1\s+0\s+lost\b", lost), shown
        assert not re.search(r"\(HEALTHY, posted", shown), shown

        # A new node takes the free place at once: it is not told the job is full.
        third = start(tmp_path, leaks, rdzv, "third", job, *flags, env=NOTICE)
        nodes.append(third)
        wait_until(lambda: len(third.stdout()) == 1, 60, "the new node's worker")
        wait_until(lambda: len(first.stdout()) == 2, 60, "the first node's worker again")
        (tmp_path / "go").touch()
        assert (first.wait(), third.wait()) == (0, 0), first.stderr() + third.stderr()
    finally:
        stop_all(nodes)
    assert "is full" not in third.stderr() and "spare" not in third.stderr(), third.stderr()
    assert sorted([first.stdout()[1], *third.stdout()]) == ["world 2 rank 0", "world 2 rank 1"]
