"""What a waiting node says, and how ``relaunch status`` judges a node's post: the pure lines
(``core.rendezvous.rounds.wait_line``, ``core.output.status``), as tables; the agents that say
them: tests/integration/test_waits_spoken.py."""

from __future__ import annotations

import pytest

from relaunch.core.durations import span
from relaunch.core.output import status as core
from relaunch.core.output import status_table
from relaunch.core.rendezvous import rounds as plan

TWO = plan.Settings(2, 2, join_timeout=600, last_call_timeout=30)
TWO_TO_FOUR = plan.Settings(2, 4, join_timeout=600, last_call_timeout=30)
AT = "127.0.0.1:29411"


@pytest.mark.parametrize(
    "settings, waiting, where, now, give_up_at, line",
    [
        (
            TWO,
            plan.Waiting(1),
            AT,
            30.0,
            600.0,
            "waiting for 1 more node (1 of 2 joined, job 'j1' at 127.0.0.1:29411); "
            "giving up in 9m30s",
        ),
        (
            plan.Settings(3, 3),
            plan.Waiting(0),
            "",
            0.0,
            45.4,
            "waiting for 3 more nodes (0 of 3 joined, job 'j1'); giving up in 45s",
        ),
        (
            TWO_TO_FOUR,
            plan.Waiting(1),
            AT,
            20.0,
            600.0,
            "waiting for 1 more node (1 of 2 to 4 joined, job 'j1' at 127.0.0.1:29411); "
            "giving up in 9m40s",
        ),
        (
            TWO_TO_FOUR,
            plan.Waiting(3, last_call_at=50.0),
            AT,
            25.0,
            600.0,
            "waiting up to 25s for more nodes (3 of 2 to 4 joined, job 'j1' at "
            "127.0.0.1:29411); then starting with 3",
        ),
        (
            TWO,
            plan.Waiting(2),
            AT,
            599.5,
            600.0,
            "waiting for the round to complete (2 of 2 joined, job 'j1' at 127.0.0.1:29411); "
            "giving up in 0.5s",
        ),
        (
            TWO,
            plan.Waiting(1, running=2),
            AT,
            700.0,
            600.0,
            "waiting as a spare for a place in job 'j1' at 127.0.0.1:29411 (2 of at most 2 "
            "nodes running): it takes the place of a node that is lost, for as long as the "
            "job runs",
        ),
    ],
)
def test_a_waiting_node_says_what_for_how_many_where_and_until_when(
    settings: plan.Settings,
    waiting: plan.Waiting,
    where: str,
    now: float,
    give_up_at: float,
    line: str,
) -> None:
    assert plan.wait_line(settings, waiting, "j1", where, now, give_up_at) == line


@pytest.mark.parametrize(
    "value, words",
    [(0.25, "0.25s"), (9.5, "9.5s"), (45.4, "45s"), (60, "1m"), (570, "9m30s"), (3900, "1h05m")],
)
def test_a_span_reads_as_a_person_says_it(value: float, words: str) -> None:
    assert span(value) == words


@pytest.mark.parametrize(
    "value, after, wrong",
    [
        (None, plan.NOTICE_AFTER, None),
        ("", plan.NOTICE_AFTER, None),
        ("0.5", 0.5, None),
        ("0", plan.NOTICE_AFTER, "RELAUNCH_WAIT_NOTICE='0' is not a number of seconds above 0"),
        ("soon", plan.NOTICE_AFTER, "RELAUNCH_WAIT_NOTICE='soon' is not a number"),
        ("inf", plan.NOTICE_AFTER, "RELAUNCH_WAIT_NOTICE='inf' is not a number"),
    ],
)
def test_the_first_wait_line_comes_after_relaunch_wait_notice_seconds(
    value: str | None, after: float, wrong: str | None
) -> None:
    got, said = plan.notice_after(value)
    assert got == after
    assert (said is None) == (wrong is None)
    if wrong is not None:
        assert said is not None and said.startswith(wrong) and said.endswith("using 20s")
    assert plan.NOTICE_AFTER <= 30  # the first line comes within 30 s by default


def post(group_rank: int, posted_at: float, stale_after: float | None = 6.0) -> core.NodeStatus:
    rank = core.RankStatus(group_rank, 0, "running")
    return core.NodeStatus("vm", group_rank, "HEALTHY", 0, posted_at, [rank], [], 0.0, stale_after)


NOW = 1000.0


@pytest.mark.parametrize(
    "node, standing, health, words",
    [
        (post(0, NOW - 2), core.Standing(), "posted", "vm (HEALTHY, posted 2.0s ago)"),
        (
            post(0, NOW - 7),
            core.Standing(),
            "stale",
            "vm (STALE: no post for 7s, was HEALTHY)",
        ),
        (  # a post that does not say: the default detection time
            post(0, NOW - 7, None),
            core.Standing(),
            "posted",
            "vm (HEALTHY, posted 7.0s ago)",
        ),
        (
            post(0, NOW - 36.5, None),
            core.Standing(),
            "stale",
            "vm (STALE: no post for 36.5s, was HEALTHY)",
        ),
        (
            post(1, NOW - 3.5),
            core.Standing(over=True, lost=1),
            "lost",
            "vm (LOST, last posted 3.5s ago)",
        ),
        (
            post(0, NOW - 3.5),
            core.Standing(over=True, lost=1),
            "past",
            "vm (was HEALTHY, posted 3.5s ago)",
        ),
    ],
)
def test_a_node_is_shown_healthy_only_while_its_post_holds(
    node: core.NodeStatus, standing: core.Standing, health: str, words: str
) -> None:
    assert status_table.health(node, standing, NOW) == health
    assert status_table.node_words(node, standing, NOW) == words


@pytest.mark.parametrize(
    "standing, words",
    [
        (core.Standing(formed_at=NOW - 1), "(starting: its first post is due within 3s)"),
        (core.Standing(formed_at=NOW - 8), "(STALE: no post 8s after the round formed)"),
        (core.Standing(), "(no status posted yet)"),
        (core.Standing(over=True, lost=1, formed_at=NOW - 1), "(LOST before its first post)"),
    ],
)
def test_a_member_that_posted_nothing_says_what_is_coming(
    standing: core.Standing, words: str
) -> None:
    assert status_table.missing_words(1, standing, NOW) == words


def test_the_table_never_shows_a_lost_or_stale_node_healthy() -> None:
    standing = core.Standing(over=True, lost=1)
    table = status_table.format_table(
        "j1", [post(0, NOW - 3), post(1, NOW - 3)], None, 0, NOW, "", 2, standing
    )
    lost = next(line for line in table.splitlines() if "LOST" in line)
    assert "HEALTHY" not in lost and " lost" in lost
    stale = status_table.format_table("j1", [post(0, NOW - 40)], None, 0, NOW)
    assert "HEALTHY," not in stale and "unknown" in stale
    data = status_table.as_json("j1", [post(0, NOW - 40)], None, 0, 1, core.Standing(), NOW)
    assert data["nodes"][0]["health"] == "stale"


@pytest.mark.parametrize(
    "joined, low, high, words",
    [(1, 2, 2, "1 of 2 joined"), (3, 2, 4, "3 of 2 to 4 joined"), (0, 1, 1, "0 of 1 joined")],
)
def test_a_forming_round_says_how_many_of_how_many_joined(
    joined: int, low: int, high: int, words: str
) -> None:
    assert plan.joined_words(joined, low, high) == words
    assert plan.decode_size(plan.encode_size(plan.Settings(low, high))) == (low, high)


@pytest.mark.parametrize("raw", [b"", b"2", b"a:b", b"3:2", b"0:1", b"1:2:3"])
def test_a_size_no_relaunch_wrote_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        plan.decode_size(raw)
