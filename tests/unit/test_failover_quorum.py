"""How many members must beat into the built-in store's primary for it to go on serving
(``rendezvous.failover.quorum_needed``): the rule that keeps two stores from running one job;
and who may vote a standby into its place (``job_electorate``), read from its copy."""

from __future__ import annotations

import json

import pytest

from relaunch.rendezvous.failover import job_electorate, majority, quorum_needed, voter_name
from relaunch.rendezvous.rounds import CLOSED, job_key


@pytest.mark.parametrize(("members", "needed"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_a_majority_is_more_than_half(members: int, needed: int) -> None:
    assert majority(members) == needed


@pytest.mark.parametrize(
    ("members", "previous", "needed"),
    [
        (2, [], 0),  # a round of two: nobody else can take over
        (1, [2], 0),  # nor after one of two
        (3, [], 2),
        (5, [3], 3),  # its own majority
        (2, [3], 2),  # a node lost from three: the two left are a majority of the three
        (1, [3], 2),  # a lone node after three: the other two may run the job elsewhere
        (1, [5], 3),
    ],
)
def test_a_round_needs_its_own_majority_and_that_of_the_round_before(
    members: int, previous: list[int], needed: int
) -> None:
    assert quorum_needed(members, previous) == needed


def _final(count: object) -> bytes:
    return json.dumps(
        {"count": count, "world_size": 3, "master_addr": "h", "master_port": 1}
    ).encode()


@pytest.mark.parametrize(
    ("keys", "round_", "count"),
    [
        ({}, None, 0),  # no round completed yet: nobody may vote
        ({"round": b"0", "r0": _final(3)}, 0, 3),
        ({"r0": _final(3)}, 0, 3),  # the round key was never written
        ({"round": b"4", "r3": _final(5), "r4": _final(3)}, 4, 3),
        ({"round": b"5", "r4": _final(3)}, 4, 3),  # round 5 is joined now
        ({"round": b"4", "r4": _final(3), "r5": _final(4)}, 5, 4),  # the key lags round 5
        ({"round": b"4", "r4": CLOSED}, None, 0),  # the job finished
        ({"round": b"x"}, None, 0),
        ({"round": b"0", "r0": _final(True)}, None, 0),
        ({"round": b"0", "r0": b"[1]"}, None, 0),
        ({"round": b"0", "r0": b"\xff"}, None, 0),
        ({"round": b"0", "r0": b"[" * 100_000}, None, 0),  # deeper than json can read
    ],
)
def test_a_standby_reads_its_voters_from_the_last_completed_round(
    keys: dict[str, bytes], round_: int | None, count: int
) -> None:
    named = {
        job_key("j", "round") if name == "round" else job_key("j", "final", int(name[1:])): value
        for name, value in keys.items()
    }
    electorate = job_electorate("j")(named.get)
    if round_ is None:
        assert electorate is None
        return
    assert electorate is not None and electorate.quorum == majority(count)
    assert [voter_name(round_, rank) in electorate.voters for rank in range(count + 1)] == [
        *[True] * count,
        False,
    ]
    for stranger in (
        voter_name(round_ - 1, 0),
        voter_name(round_ + 1, 0),
        "intruder",
        f"{round_}/-1",
    ):
        assert stranger not in electorate.voters
