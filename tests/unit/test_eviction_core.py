"""Evicting a straggling node to a spare (``core.workers.eviction``): the rules as table rows,
and the view that carries the decision to the node evicted."""

from __future__ import annotations

import pytest

from relaunch.core.output.status import JobView
from relaunch.core.workers.eviction import Evict, NoSpare, Watch, decide
from relaunch.core.workers.stragglers import SlowNode

B = SlowNode("host-b", 1, (2, 3), "compute", 0.5, 0.1, 1.5)
C = SlowNode("host-c", 2, (4, 5), "", 8.0, 45.0, 1.5)

#: (why, watch, flagged now, now, members, min_nodes, spares) -> the node evicted, "no spare"
#: said, or nothing; the window is 10 s.
ROWS = [
    ("first flag: the window starts", Watch(), [B], 100.0, 2, 2, 1, None),
    ("flagged 9 s: within the window", Watch({"host-b": 91.0}), [B], 100.0, 2, 2, 1, None),
    ("flagged 10 s, a spare waits", Watch({"host-b": 90.0}), [B], 100.0, 2, 2, 1, "host-b"),
    ("flagged 10 s, no spare: said", Watch({"host-b": 90.0}), [B], 100.0, 2, 2, 0, "no spare"),
    (
        "no spare, already said: said once",
        Watch({"host-b": 90.0}, frozenset({"host-b"})),
        [B],
        103.0,
        2,
        2,
        0,
        None,
    ),
    ("no spare above MIN: only flagged", Watch({"host-b": 90.0}), [B], 100.0, 3, 2, 0, "no spare"),
    ("never below MIN", Watch({"host-b": 90.0}), [B], 100.0, 2, 3, 1, "no spare"),
    (
        "two due at once: the one flagged longer, alone",
        Watch({"host-b": 90.0, "host-c": 80.0}),
        [B, C],
        100.0,
        3,
        2,
        2,
        "host-c",
    ),
    (
        "a round that evicted one evicts no other",
        Watch({"host-b": 80.0}, evicted="host-c", evicted_at=95.0, evicting=True),
        [B],
        100.0,
        2,
        2,
        1,
        None,
    ),
    (
        "the node evicted last, on flags from before its eviction",
        Watch({"host-b": 80.0}, evicted="host-b", evicted_at=95.0),
        [B],
        100.0,
        2,
        2,
        1,
        None,
    ),
    (
        "the node evicted last, measured again after it",
        Watch({"host-b": 96.0}, evicted="host-b", evicted_at=95.0),
        [B],
        106.0,
        2,
        2,
        1,
        "host-b",
    ),
    ("a node no longer flagged: nothing", Watch({"host-b": 80.0}), [], 100.0, 2, 2, 1, None),
]


@pytest.mark.parametrize(
    ("why", "watch", "flagged", "now", "members", "min_nodes", "spares", "expected"),
    ROWS,
    ids=[row[0] for row in ROWS],
)
def test_the_rules_of_eviction(
    why: str,
    watch: Watch,
    flagged: list[SlowNode],
    now: float,
    members: int,
    min_nodes: int,
    spares: int,
    expected: str | None,
) -> None:
    after, decided = decide(watch, flagged, now, 10.0, members, min_nodes, spares)
    if expected is None:
        assert decided is None, why
    elif expected == "no spare":
        assert isinstance(decided, NoSpare) and "no spare is waiting" in decided.line, why
        assert decided.node in after.told
    else:
        assert isinstance(decided, Evict) and decided.node == expected, why
        assert after.evicting and after.evicted == expected and after.evicted_at == now


def test_a_streak_broken_starts_again() -> None:
    """A node must be flagged in every judgement of the window: a judgement without it starts
    the window again."""
    watch, _ = decide(Watch(), [B], 0.0, 5.0, 2, 2, 1)
    watch, _ = decide(watch, [], 3.0, 5.0, 2, 2, 1)
    assert watch.since == {}
    watch, first = decide(watch, [B], 6.0, 5.0, 2, 2, 1)
    watch, second = decide(watch, [B], 9.0, 5.0, 2, 2, 1)
    watch, third = decide(watch, [B], 11.0, 5.0, 2, 2, 1)
    assert first is None and second is None and isinstance(third, Evict)


def test_a_new_round_measures_afresh_and_may_evict_again() -> None:
    watch, decided = decide(Watch({"host-b": 0.0}), [B], 10.0, 5.0, 3, 2, 1)
    assert isinstance(decided, Evict)
    watch = watch.new_round()
    assert not watch.evicting and watch.since == {} and watch.evicted == "host-b"
    watch, decided = decide(watch, [C], 12.0, 5.0, 3, 2, 1)
    watch, decided = decide(watch, [C], 17.0, 5.0, 3, 2, 1)
    assert isinstance(decided, Evict) and decided.node == "host-c"


def test_the_line_names_the_node_its_ranks_and_why() -> None:
    _, decided = decide(Watch({"host-b": 70.0}), [B], 100.0, 30.0, 2, 2, 1)
    assert isinstance(decided, Evict)
    assert decided.line == (
        "node host-b (node 1, ranks 2-3) evicted as a straggler ('compute' takes 0.50 s a step, "
        "the other nodes' median is 0.10 s) for 30 s; a spare takes its place"
    )


def test_the_view_carries_the_node_evicted() -> None:
    view = JobView(45.0, {3: 9.0}, None, None, None, 100.0, evict=Evict("host-b", 1, "evicted"))
    assert JobView.decode(view.encode()) == view
    plain = JobView(45.0, {3: 9.0}, None, None, None, 100.0)
    assert JobView.decode(plain.encode()).evict is None
    with pytest.raises(ValueError, match="node_rank"):
        JobView.decode(b'{"posted_at": 1, "evict": {"node": "b", "node_rank": "1", "line": ""}}')
