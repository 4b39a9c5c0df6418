"""Stragglers judged by node (``core.workers.stragglers.flagged_nodes``): by the seconds a step
each rank spends in its sections (synchronous training, where every rank steps at the same
pace), and by steps per second (asynchronous work); the seconds a step from the channel's
samples (``SectionTimes``); the job's view carrying the nodes flagged."""

from __future__ import annotations

import random
import statistics

import pytest

from relaunch.core.output import status as core
from relaunch.core.output import status_table
from relaunch.core.workers.stragglers import (
    Measured,
    SectionTimes,
    SlowNode,
    _median_without,
    flagged_nodes,
    ranks_text,
)


def job(
    nodes: int, per_node: int, sections: dict[int, dict[str, float]], rates: dict[int, float]
) -> list[Measured]:
    """``nodes`` nodes named host-<n> of ``per_node`` ranks; each rank's seconds a step in its
    sections and its rate (none where not given)."""
    return [
        Measured(
            f"host-{node}",
            node,
            rank,
            rates.get(rank),
            sections.get(rank, {}),
        )
        for node in range(nodes)
        for rank in range(node * per_node, (node + 1) * per_node)
    ]


def same(ranks: range, value: dict[str, float]) -> dict[int, dict[str, float]]:
    return {rank: value for rank in ranks}


SYNC_PACE = dict.fromkeys(range(8), 9.7)  # a collective every step: every rank at one pace

#: (case, the job, the nodes flagged: (node rank, ranks, section, value, median)).
CASES: list[tuple[str, list[Measured], list[tuple[int, tuple[int, ...], str, float, float]]]] = [
    (
        "synchronous: node 1 computes 5x slower, every rank at the same pace",
        job(
            2,
            4,
            {**same(range(4), {"compute": 0.1}), **same(range(4, 8), {"compute": 0.52})},
            SYNC_PACE,
        ),
        [(1, (4, 5, 6, 7), "compute", 0.52, 0.1)],
    ),
    (
        "synchronous: every node at the same time",
        job(2, 4, same(range(8), {"compute": 0.1}), SYNC_PACE),
        [],
    ),
    (
        "within the factor (1.4x)",
        job(2, 1, {0: {"compute": 0.1}, 1: {"compute": 0.14}}, {}),
        [],
    ),
    (
        "past the factor but by less than MIN_EXCESS (4 ms against 1 ms)",
        job(2, 1, {0: {"compute": 0.001}, 1: {"compute": 0.004}}, {}),
        [],
    ),
    (
        "one rank of four on node 2 slow in 'data', the step section the same everywhere",
        job(
            4,
            2,
            {
                **same(range(8), {"step": 1.0, "data": 0.05}),
                5: {"step": 1.0, "data": 0.4},
            },
            {},
        ),
        [(2, (5,), "data", 0.4, 0.05)],
    ),
    (
        "the section furthest behind is the one named",
        job(2, 1, {0: {"a": 0.1, "b": 0.1}, 1: {"a": 0.2, "b": 0.5}}, {}),
        [(1, (1,), "b", 0.5, 0.1)],
    ),
    (
        "a section no other node runs has nothing to be measured against",
        job(2, 1, {0: {"compute": 0.1}, 1: {"compute": 0.1, "eval": 3.0}}, {}),
        [],
    ),
    (
        "one node: nothing to measure its sections against",
        job(1, 4, {0: {"compute": 0.1}, 3: {"compute": 0.5}}, {}),
        [],
    ),
    (
        "asynchronous: rank 3 steps slower, no sections: flagged by its rate",
        job(2, 2, {}, {0: 10.0, 1: 10.0, 2: 10.0, 3: 2.0}),
        [(1, (3,), "", 2.0, 10.0)],
    ),
    (
        "one node, by rates: its slow rank",
        job(1, 3, {}, {0: 100.0, 1: 90.0, 2: 20.0}),
        [(0, (2,), "", 20.0, 90.0)],
    ),
    (
        "asynchronous with sections: both find node 1, named once, by its section",
        job(
            2,
            2,
            {**same(range(2), {"compute": 0.1}), 2: {"compute": 0.1}, 3: {"compute": 0.5}},
            {0: 10.0, 1: 10.0, 2: 10.0, 3: 2.0},
        ),
        [(1, (3,), "compute", 0.5, 0.1)],
    ),
    (
        "a node slow by its section, another by a rate: both, in node order",
        job(
            3,
            1,
            {0: {"compute": 0.1}, 1: {"compute": 0.1}, 2: {"compute": 0.9}},
            {0: 10.0, 1: 1.0, 2: 10.0},
        ),
        [(1, (1,), "", 1.0, 10.0), (2, (2,), "compute", 0.9, 0.1)],
    ),
]


@pytest.mark.parametrize(("case", "measured", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_nodes_flagged(
    case: str,
    measured: list[Measured],
    expected: list[tuple[int, tuple[int, ...], str, float, float]],
) -> None:
    flagged = flagged_nodes(measured, 1.5)
    got = [(n.node_rank, n.ranks, n.section, n.value, n.median) for n in flagged]
    assert got == [(n, r, s, pytest.approx(v), pytest.approx(m)) for n, r, s, v, m in expected]
    assert all(n.node == f"host-{n.node_rank}" and n.factor == 1.5 for n in flagged)
    assert flagged_nodes(list(reversed(measured)), 1.5) == flagged  # the order of the posts


def test_what_a_node_flagged_says() -> None:
    (by_section,) = flagged_nodes(CASES[0][1], 1.5)
    assert by_section.describe() == (
        "node host-1 (node 1, ranks 4-7) is a straggler: 'compute' takes 0.52 s a step, "
        "the other nodes' median is 0.10 s"
    )
    (by_rate,) = flagged_nodes(CASES[8][1], 1.5)
    assert by_rate.describe() == (
        "node host-1 (node 1, rank 3) is a straggler: 2 steps/s, the job's median is 10 "
        "(flagged below 1/1.5 of it)"
    )
    fast = SlowNode("h", 0, [1, 3], "io", 0.012, 0.0031, 2.0)
    assert fast.describe().endswith(
        "'io' takes 0.012 s a step, the other nodes' median is 0.0031 s"
    )
    assert [ranks_text(r) for r in ([3], [4, 5, 6, 7], [1, 3], [2, 3, 5])] == [
        "rank 3",
        "ranks 4-7",
        "ranks 1, 3",
        "ranks 2, 3, 5",
    ]


def test_the_median_without_a_nodes_values_is_the_median_of_the_rest() -> None:
    rng = random.Random(47)
    for _ in range(500):
        values = sorted(
            rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(rng.randint(1, 12))
        )
        removed = rng.sample(values, rng.randint(0, len(values)))
        rest = list(values)
        for value in removed:
            rest.remove(value)
        expected = statistics.median(rest) if rest else None
        assert _median_without(values, removed) == expected, (values, removed)


def test_seconds_a_step_over_the_window() -> None:
    times = SectionTimes()
    times.add(0, 100.0, 10, {"compute": (5.0, 10)})
    assert times.per_step() == {}  # one sample: nothing to measure yet
    times.add(0, 103.0, 40, {"compute": (8.0, 40), "data": (1.0, 40)})
    times.add(1, 100.0, None, {"compute": (1.0, 4)})  # reports no steps: by the runs
    times.add(1, 103.0, None, {"compute": (3.0, 8)})
    times.add(1, 103.0, None, {"compute": (9.0, 9)})  # not newer: ignored
    times.add(2, 100.0, 5, {})  # no section ever ended: no sample
    assert times.per_step() == {0: {"compute": pytest.approx(0.1)}, 1: {"compute": 0.5}}
    step, spent = 40, 8.0
    for at in (106.0, 109.0, 112.0, 115.0, 118.0):  # slow from 103 on: 6 steps of 0.5 s in 3 s
        step, spent = step + 6, spent + 3.0
        times.add(0, at, step, {"compute": (spent, step)})
    # Only the last 6 s count: the samples from 112 on, every step of them slow.
    assert times.per_step()[0] == {"compute": pytest.approx(0.5)}


def test_the_job_view_carries_the_nodes_flagged_and_their_measurements() -> None:
    posts = [
        core.NodeStatus(
            f"host-{node}",
            node,
            "HEALTHY",
            0,
            1000.0,
            [
                core.RankStatus(rank, rank % 2, "running", 50, None, 9.7, 999.0, {"compute": t})
                for rank, t in ((2 * node, 0.1 + 0.4 * node), (2 * node + 1, 0.1 + 0.4 * node))
            ],
        )
        for node in range(2)
    ]
    for post in posts:
        assert core.NodeStatus.decode(post.encode()) == post
    view = core.job_view(posts, 1.5, 1001.0)
    assert view.stragglers == {}  # one pace: no rank below the median rate
    assert view.slow_nodes == [SlowNode("host-1", 1, [2, 3], "compute", 0.5, 0.1, 1.5)]
    assert view.slow_ranks() == {2, 3}
    assert core.JobView.decode(view.encode()) == view
    table = status_table.format_table("j", posts, view, 0, 1001.0).splitlines()
    assert len([line for line in table if line.endswith("  straggler")]) == 2
    assert table[-1] == (
        "  straggler: node host-1 (node 1, ranks 2-3) is a straggler: 'compute' takes 0.50 s a "
        "step, the other nodes' median is 0.10 s"
    )


@pytest.mark.parametrize(
    "bad",
    [
        b'{"sections": {"compute": -1}}',
        b'{"sections": {"compute": "0.1"}}',
        b'{"sections": {"compute": NaN}}',
        b'{"sections": [1]}',
        b'{"sections": {"' + b"x" * 129 + b'": 1}}',
        b'{"sections": {' + b",".join(b'"%d": 1' % i for i in range(9)) + b"}}",
    ],
)
def test_a_ranks_sections_from_the_store_are_checked(bad: bytes) -> None:
    rank = bad.decode()[1:-1]
    raw = (
        '{"node":"h","group_rank":0,"state":"HEALTHY","restarts":0,"posted_at":1,'
        f'"ranks":[{{"rank":0,"local_rank":0,"state":"running",{rank}}}]}}'
    )
    with pytest.raises(ValueError, match="sections"):
        core.NodeStatus.decode(raw.encode())


@pytest.mark.parametrize(
    "bad",
    [
        '"slow_nodes": {}',
        '"slow_nodes": [{"node": "h", "node_rank": 1, "ranks": [], "section": "", "value": 1,'
        ' "median": 1, "factor": 1.5}]',
        '"slow_nodes": [{"node": "h", "node_rank": 1, "ranks": ["2"], "section": "", "value": 1,'
        ' "median": 1, "factor": 1.5}]',
        '"slow_nodes": [{"node": 1, "node_rank": 1, "ranks": [2], "section": "", "value": 1,'
        ' "median": 1, "factor": 1.5}]',
    ],
)
def test_the_nodes_flagged_from_the_store_are_checked(bad: str) -> None:
    with pytest.raises(ValueError):
        core.JobView.decode(f'{{"posted_at": 1, {bad}}}'.encode())
