"""A short chaos run (tests/chaos/harness.py): a worker or a whole node of a real relaunch job is
killed at a chosen moment, on one node, on two nodes over the built-in store and on two nodes
over etcd; the job must finish with the right result, leave no process behind, lose no log line
and name the fault in its report. ``python -m benchmarks chaos --runs 60`` is the long version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos import harness as chaos
from tests.chaos.worker import ITEMS, advance, item
from tests.support.procs import LeakCheck

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

#: A seed whose eight runs try every fault and every topology, and a node kill on both c10d
#: (never the node hosting the store) and etcd.
SEED = 24
PLANS = chaos.plan_runs(SEED, 8)


def test_the_short_run_tries_every_fault_on_every_topology() -> None:
    assert {plan.fault for plan in PLANS} == set(chaos.FAULTS)
    assert {plan.topology for plan in PLANS} == set(chaos.TOPOLOGIES)
    node_kills = {plan.topology: plan.node for plan in PLANS if plan.fault == "node"}
    assert set(node_kills) == {"c10d", "etcd"}
    assert node_kills["c10d"] != 0, "node 0 hosts the c10d store: its death ends the job"


def test_a_seed_gives_the_same_runs_whatever_their_number() -> None:
    assert chaos.plan_runs(SEED, 3) == PLANS[:3]
    assert chaos.plan_runs(SEED, 8) == PLANS
    assert chaos.plan_runs(SEED + 1, 8) != PLANS


def test_the_expected_result_does_not_depend_on_the_world_size() -> None:
    def compute(world: int) -> int:
        value = 0
        for step in range(chaos.STEPS):
            items = range(step * ITEMS, (step + 1) * ITEMS)
            parts = [sum(item(i) for i in items if i % world == rank) for rank in range(world)]
            value = advance(value, sum(parts))
        return value

    assert compute(1) == compute(2) == compute(4) == chaos.expected_value()


@pytest.mark.parametrize("plan", PLANS, ids=[plan.label() for plan in PLANS])
def test_a_job_survives_the_fault_and_reports_it(
    plan: chaos.Plan, tmp_path: Path, leaks: LeakCheck, request: pytest.FixtureRequest
) -> None:
    endpoints = ""
    if plan.topology == "etcd":  # fails (never skips) without etcd, as the etcd fixtures do
        endpoints = request.getfixturevalue("etcd_shared").endpoints
    outcome = chaos.run_plan(plan, str(tmp_path), endpoints, mark=leaks.mark, timeout=40)
    if not outcome.ok:
        pytest.fail(outcome.explain(), pytrace=False)
