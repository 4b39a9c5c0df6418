"""The store's failover when replica groups share one c10d store (``--replica-groups`` on
several nodes): the whole job votes, not one group.

Each group forms its own rounds (run id ``RUN_ID-group{g}``), but the store, and the lighthouse
beside it, serve every group: whether it moves is the job's decision. So a standby counts the
votes of the members of every group's last completed round (``groups_electorate``), a majority
of all of them at once, and the primary fences when fewer than a majority of the members of
every group's running round beat into it (``other_groups_beats``, for ``MajorityWatch``). Two
groups of two nodes (four agents) move the store when its host dies, where each group alone
(two members, the host one of them) never could.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

from relaunch.core.run.replica_groups import MAX_GROUPS, group_run_id, job_of_group
from relaunch.rendezvous.rounds import CLOSED, job_key
from relaunch.store.api import Store
from relaunch.store.replication import Elect, Electorate

#: How far from a group's ``round`` key its last completed round is looked for: the key names
#: that round, the one after it (being joined), or lags the round just completed.
ROUNDS_AROUND = 2

Read = Callable[[str], "bytes | None"]


def last_round(read: Read, run_id: str) -> tuple[int, int] | None:
    """The last round of ``run_id`` completed in the store ``read`` reads, and its member
    count; None before one completed, once the job finished, or when the keys are not
    relaunch's."""
    import json

    try:
        latest = int(read(job_key(run_id, "round")) or b"0")
    except ValueError:
        return None  # not a round number: no relaunch wrote it
    for round_ in range(latest + ROUNDS_AROUND, max(latest - ROUNDS_AROUND, 0) - 1, -1):
        record = read(job_key(run_id, "final", round_))
        if record is None:
            continue
        if record == CLOSED:
            return None
        try:
            count = json.loads(record)["count"]
        except (ValueError, KeyError, TypeError, RecursionError):  # not a round's record
            return None
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return None
        return round_, count
    return None


def group_rounds(read: Read, job: str) -> dict[str, tuple[int, int]]:
    """Each group of ``job`` that has a last completed round: its run id, that round and its
    member count."""
    rounds = {}
    for group in range(MAX_GROUPS):
        run_id = group_run_id(job, group)
        if read(job_key(run_id, "round")) is None:
            break
        last = last_round(read, run_id)
        if last is not None:
            rounds[run_id] = last
    return rounds


class Members(Container[str]):
    """The voter names (``failover.voter_name``) of the members of some rounds: by run id (``""``:
    the one job's, whose voters name no run id), the round and its member count."""

    def __init__(self, rounds: Mapping[str, tuple[int, int]]) -> None:
        self._rounds = rounds

    def __contains__(self, voter: object) -> bool:
        name, _, run_id = str(voter).partition("@")
        round_, _, rank = name.partition("/")
        last = self._rounds.get(run_id)
        return (
            last is not None and round_ == str(last[0]) and rank.isdigit() and int(rank) < last[1]
        )


def groups_electorate(job: str, own: str, majority: Callable[[int], int]) -> Elect:
    """Who may vote a standby of ``job``'s store into its primary's place: the members of every
    group's last completed round, ``majority`` of all of them at once; ``own`` (this node's
    group's run id) counts even past a missing group."""

    def elect(read: Read) -> Electorate | None:
        rounds = group_rounds(read, job)
        last = rounds.get(own) or last_round(read, own)
        if last is not None:
            rounds[own] = last
        members = sum(count for _, count in rounds.values())
        return Electorate(Members(rounds), majority(members)) if members else None

    return elect


def other_groups_beats(own: str) -> Callable[[Store], list[list[str]]] | None:
    """For the primary's fence watch: the heartbeat keys of the members of each other group's
    running round, when ``own`` (this node's rendezvous) is a replica group's; None otherwise. A
    group re-forming (its round superseded) is left out, as the watch leaves out its own
    between rounds: nothing beats."""
    job = job_of_group(own)
    if job is None:
        return None

    def beats(store: Store) -> list[list[str]]:
        found = []
        for run_id, (round_, count) in group_rounds(lambda key: store.get(key).value, job).items():
            if run_id == own or store.get(job_key(run_id, "changed", round_)).value is not None:
                continue
            found.append([job_key(run_id, f"hb/{rank}", round_) for rank in range(count)])
        return found

    return beats
