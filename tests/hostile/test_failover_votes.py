"""The built-in store's failover against forged votes (issue 43, item 3).

Before: a standby took the quorum from each vote (the largest one it ever saw) and counted any
voter's name, so one forged ``PROMOTE(quorum=1)`` made it a second primary (a job split in two),
one with quorum 10**6 turned failover off for good, and a member's vote that timed out with
quorum 10 made the next two valid votes of a round of 3 fail. Now the standby counts by itself:
the members of the last round completed in its copy of the store, a majority of them at once,
each vote while its request waits. (Without a token there is no failover:
test_store_without_token.py.)

Real servers on loopback: a primary, and a standby that followed it until it was lost.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from conftest import wait_until

from relaunch.rendezvous.failover import job_electorate
from relaunch.rendezvous.rounds import job_key
from relaunch.store import wire
from relaunch.store.api import StoreError
from relaunch.store.client import TcpStore
from relaunch.store.server import TcpStoreServer

pytestmark = pytest.mark.timeout(60)

TOKEN = "votes-token"
JOB = "job42"
#: The last round completed: round 2, of three members (group ranks 0-2).
ROUND, MEMBERS = 2, 3


@pytest.fixture
def standby() -> Iterator[TcpStoreServer]:
    """A standby of job ``JOB``'s store, holding a whole copy of it after round 2 completed
    with 3 members; its primary is gone (its stream ended), as when its host is lost."""
    primary = TcpStoreServer("127.0.0.1", 0, TOKEN).start()
    standby = TcpStoreServer("127.0.0.2", 0, TOKEN).start()
    try:
        with TcpStore("127.0.0.1", primary.port, TOKEN) as client:
            final = {"count": MEMBERS, "world_size": MEMBERS, "master_addr": "h", "master_port": 1}
            client.set(job_key(JOB, "final", ROUND - 1), json.dumps({**final, "count": 5}).encode())
            client.set(job_key(JOB, "final", ROUND), json.dumps(final).encode())
            client.set(job_key(JOB, "round"), str(ROUND).encode())
        standby.follow("127.0.0.1", primary.port, job_electorate(JOB))
        wait_until(lambda: standby.synced, what="the standby's snapshot")
        primary.stop()
        wait_until(lambda: not standby.following, what="the stream's end")
        yield standby
    finally:
        standby.stop()
        primary.stop()


def votes(standby: TcpStoreServer, voters: list[str], timeout: float) -> list[bool]:
    """Each of ``voters`` asks ``standby`` to take over at once, on its own connection: whether
    it was promoted, for each."""
    answers: dict[str, bool] = {}

    def vote(voter: str) -> None:
        with TcpStore("127.0.0.2", standby.port, TOKEN, timeout=timeout + 5) as store:
            answers[voter] = store.promote(voter, timeout)

    threads = [threading.Thread(target=vote, args=(voter,)) for voter in voters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return [answers[voter] for voter in voters]


def test_votes_from_outside_the_last_round_do_not_promote_a_standby(
    standby: TcpStoreServer,
) -> None:
    # Anyone else's name, a member of an earlier round, a group rank past the round's, a
    # round not completed: six votes at once, where a majority of round 2 is two.
    outsiders = ["intruder", "1/0", "1/4", "2/3", "3/0", "2/-1"]
    assert votes(standby, outsiders, 0.5) == [False] * len(outsiders)
    assert standby.standby
    # One member with them is no majority either; two members are.
    assert votes(standby, ["2/0", "intruder", "1/1"], 0.5) == [False] * 3
    assert standby.standby
    assert votes(standby, ["2/0", "2/2"], 10) == [True, True]
    assert not standby.standby


def test_a_vote_that_names_its_own_quorum_neither_promotes_nor_blocks(
    standby: TcpStoreServer,
) -> None:
    # The voter's word on the quorum is not asked for: a vote that carries one (quorum 1, or
    # 10**6 to turn failover off) is refused, as any malformed vote, and leaves nothing behind.
    with TcpStore("127.0.0.2", standby.port, TOKEN) as forger:
        for quorum in (b"1", b"1000000"):
            with pytest.raises(StoreError):
                forger._call(wire.PROMOTE, [b"2/1", quorum, b"300"], 2.0)
    assert standby.standby
    assert votes(standby, ["2/0", "2/1"], 10) == [True, True]


def test_a_lapsed_vote_is_forgotten_and_never_blocks_later_ones(
    standby: TcpStoreServer,
) -> None:
    # A member asks alone and times out; later another asks alone: the lapsed vote does not
    # make a quorum with it, nor keep the two votes that follow from making one.
    assert votes(standby, ["2/0"], 0.2) == [False]
    assert votes(standby, ["2/1"], 0.2) == [False]
    assert standby.standby
    assert votes(standby, ["2/1", "2/2"], 10) == [True, True]
    assert not standby.standby
