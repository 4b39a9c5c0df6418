"""How many members must beat into the built-in store's primary for it to go on serving
(``rendezvous.failover.quorum_needed``): the rule that keeps two stores from running one job;
and who may vote a standby into its place (``job_electorate``), read from its copy; with
replica groups, every group's members (``failover_groups``)."""

from __future__ import annotations

import json

import pytest

from relaunch.core.run.replica_groups import group_run_id, job_of_group
from relaunch.rendezvous.failover import job_electorate, majority, quorum_needed, voter_name
from relaunch.rendezvous.failover_groups import other_groups_beats
from relaunch.rendezvous.rounds import CLOSED, job_key
from relaunch.store.memory import MemoryStore


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


def _groups(*rounds: tuple[int, object] | None) -> dict[str, bytes]:
    """The keys of job ``j``'s replica groups in order: each group's last round and its count
    (None: a group whose job finished)."""
    keys = {}
    for group, last in enumerate(rounds):
        run_id = f"j-group{group}"
        round_, count = last if last is not None else (1, None)
        keys[job_key(run_id, "round")] = str(round_).encode()
        keys[job_key(run_id, "final", round_)] = CLOSED if last is None else _final(count)
    return keys


def test_replica_groups_vote_together_each_member_naming_its_group() -> None:
    """Two groups of two (the store's host one of the four): three of four are a majority,
    where each group alone (two members, the host one of them) has none without the host."""
    electorate = job_electorate("j-group1")(_groups((3, 2), (5, 2)).get)
    assert electorate is not None and electorate.quorum == 3
    voters = electorate.voters
    assert all(voter_name(3, rank, "j-group0") in voters for rank in (0, 1))
    assert all(voter_name(5, rank, "j-group1") in voters for rank in (0, 1))
    for stranger in (
        voter_name(3, 0),  # a member names its group
        voter_name(3, 2, "j-group0"),  # past the round's count
        voter_name(4, 0, "j-group0"),  # another round
        voter_name(3, 0, "j-group1"),  # group 1's round is 5
        voter_name(3, 0, "j-group2"),  # no such group
        voter_name(3, 0, "k-group0"),  # another job
    ):
        assert stranger not in voters


def test_a_finished_group_counts_for_nothing_and_the_first_missing_group_ends_the_list() -> None:
    keys = _groups(None, (2, 3))
    keys.update({k.replace("j-group1", "j-group3"): v for k, v in _groups(None, (2, 5)).items()})
    electorate = job_electorate("j-group0")(keys.get)
    assert electorate is not None and electorate.quorum == majority(3)
    assert voter_name(2, 2, "j-group1") in electorate.voters
    assert voter_name(2, 4, "j-group3") not in electorate.voters
    # A group past the missing one counts its own members: a job whose run id merely ends in
    # "-group3" still moves its store.
    own = job_electorate("j-group3")(keys.get)
    assert own is not None and own.quorum == majority(3 + 5)
    assert voter_name(2, 4, "j-group3") in own.voters
    assert job_electorate("j-group0")(_groups(None, None).get) is None


@pytest.mark.parametrize(
    ("run_id", "job"),
    [("j-group0", "j"), ("a-b-group12", "a-b"), ("j", None), ("j-group", None),
     ("-group1", None), ("j-group01", None), ("j-groupx", None)],
)  # fmt: skip
def test_a_replica_groups_run_id_names_its_job(run_id: str, job: str | None) -> None:
    assert job_of_group(run_id) == job
    if job is not None:
        assert group_run_id(job, int(run_id.rpartition("group")[2])) == run_id


def test_the_fence_watch_counts_the_other_groups_running_rounds() -> None:
    """Group 0's primary counts group 1's and group 2's members; a group re-forming (its round
    superseded) is left out, as is its own."""
    store = MemoryStore()
    for key, value in _groups((3, 2), (5, 2), (1, 3)).items():
        store.set(key, value)
    store.set(job_key("j-group2", "changed", 1), b"re-forming")
    beats = other_groups_beats("j-group0")
    assert beats is not None and other_groups_beats("j") is None
    assert beats(store) == [[job_key("j-group1", f"hb/{rank}", 5) for rank in (0, 1)]]
