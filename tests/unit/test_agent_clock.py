"""The agent's deadlines run on its clock: a manual clock, not real time, ends the lost-node
grace (the fakes of ``test_agent_loop``: no process is started)."""

from __future__ import annotations

import logging

import pytest
from conftest import wait_until
from test_agent_loop import (
    ListeningHandler,
    Starter,
    ends_with,
    failed,
    in_thread,
    no_guardian,  # noqa: F401 - its autouse fixture applies here too
)

from relaunch.agent import LocalElasticAgent, RunResult, WorkerSpec, WorkerState
from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.runtime import ManualClock

pytestmark = pytest.mark.timeout(30)


def test_the_lost_node_grace_ends_on_the_agents_clock(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    clock = ManualClock()
    handler = ListeningHandler(grace=600.0, nodes=2)
    spec = WorkerSpec("trainer", 2, handler, entrypoint="/bin/true", max_restarts=0)
    agent = LocalElasticAgent(
        spec, log_dir=str(tmp_path), start_processes=Starter(ends_with(failed)), clock=clock
    )
    results: list[RunResult] = []
    runner = in_thread(lambda: results.append(agent.run()))
    wait_until(lambda: "waiting up to 600s for a lost node" in caplog.text, what="the grace")
    clock.advance(599.0)
    assert handler.listener is not None
    handler.listener(MembershipChange.nodes_waiting(0))  # wakes it: nothing changed
    runner.join(0.5)
    assert runner.is_alive() and not results  # 1 s of its grace left
    clock.advance(1.0)
    runner.join(10)
    assert [result.state for result in results] == [WorkerState.FAILED]
    assert handler.rounds == 1
