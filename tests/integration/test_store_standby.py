"""The built-in store's standby (docs/store-failover.md): it follows its primary's every change
with the primary's versions, redirects clients, takes over only once a quorum asks, and a
fenced store serves nobody. Real servers on loopback, real clients."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

from relaunch.store.api import StoreFenced, StoreRedirect
from relaunch.store.client import TcpStore
from relaunch.store.replication import Elect, Electorate
from relaunch.store.server import TcpStoreServer

pytestmark = pytest.mark.timeout(30)

TOKEN = "job-token"


def voters(*names: str) -> Elect:
    """An electorate of ``names``, a majority of them at once (the job's reads its rounds:
    ``failover.job_electorate``, in tests/hostile/test_failover_votes.py)."""
    return lambda read: Electorate(frozenset(names), len(names) // 2 + 1)


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    """A primary with keys already written, and a standby on another loopback address."""
    primary = TcpStoreServer("127.0.0.1", 0, TOKEN).start()
    standby = TcpStoreServer("127.0.0.2", 0, TOKEN).start()
    client = TcpStore("127.0.0.1", primary.port, TOKEN)
    client.set("before", b"1")
    client.add("count", 5)
    client.set("gone", b"x")
    standby.follow("127.0.0.1", primary.port, voters("node-a", "node-b"))
    try:
        yield primary, standby, client
    finally:
        client.close()
        standby.stop()
        primary.stop()


def test_a_standby_follows_every_change_with_the_primarys_versions(pair) -> None:  # type: ignore[no-untyped-def]
    primary, standby, client = pair
    wait_until(lambda: standby.synced, what="the standby's snapshot")
    client.add("count", 2)
    cas = client.compare_set("new", 0, b"first")
    client.delete("gone")
    last = client.set("last", b"z")
    voter = TcpStore("127.0.0.2", standby.port, TOKEN)
    try:
        with pytest.raises(StoreRedirect) as redirect:
            voter.get("before")
        assert redirect.value.primary == f"127.0.0.1:{primary.port}"
        primary.stop()  # the primary dies: what reached the standby is what counts
        wait_until(lambda: not standby.following, what="the stream's end")
        answers: list[bool] = []
        asking = threading.Thread(target=lambda: answers.append(voter.promote("node-a", 10)))
        asking.start()
        try:
            with TcpStore("127.0.0.2", standby.port, TOKEN) as other:
                assert other.promote("node-b", timeout=10)
        finally:
            asking.join()
        assert answers == [True]
        assert voter.get("count").value == b"7"
        assert voter.get("new") == cas.current
        assert voter.get("gone").value is None
        assert voter.get("last").version == last
        # Versions go on from the primary's: a compare-and-set read there still holds.
        assert voter.compare_set("new", cas.current.version, b"second").succeeded
        assert voter.set("after", b"1") > last
    finally:
        voter.close()


def test_a_standby_takes_over_only_when_a_quorum_of_distinct_voters_asks_at_once(pair) -> None:  # type: ignore[no-untyped-def]
    _, standby, _ = pair
    wait_until(lambda: standby.synced, what="the standby's snapshot")
    one = TcpStore("127.0.0.2", standby.port, TOKEN)
    two = TcpStore("127.0.0.2", standby.port, TOKEN)
    try:
        assert not one.promote("node-a", timeout=0.2), "one voter of two"
        assert not one.promote("node-a", timeout=0.2), "the same voter again"
        # A vote counts while its request waits: node-a's timed out, node-b alone is no quorum.
        assert not two.promote("node-b", timeout=0.2), "votes that do not overlap"
        assert standby.standby
        answers: list[bool] = []
        asking = threading.Thread(target=lambda: answers.append(one.promote("node-a", 10)))
        asking.start()
        try:
            assert two.promote("node-b", timeout=10)
        finally:
            asking.join()
        assert answers == [True]
        assert not standby.standby
        assert one.get("before").value == b"1"
        assert one.promote("node-a", timeout=0.2), "a primary says so at once"
    finally:
        one.close()
        two.close()


def test_a_standby_that_lost_its_primary_follows_it_again_from_a_fresh_snapshot() -> None:
    primary = TcpStoreServer("127.0.0.1", 0, TOKEN).start()
    port = primary.port
    standby = TcpStoreServer("127.0.0.2", 0, TOKEN).start()
    try:
        client = TcpStore("127.0.0.1", port, TOKEN)
        client.set("old", b"1")
        client.close()
        standby.follow("127.0.0.1", port, voters("node-a"))
        wait_until(lambda: standby.synced, what="the standby's snapshot")
        primary.stop()
        primary = TcpStoreServer("127.0.0.1", port, TOKEN).start()  # a new one in its place
        client = TcpStore("127.0.0.1", port, TOKEN)
        client.set("new", b"2")
        client.close()
        wait_until(lambda: standby.snapshots == 2, what="the snapshot of the new primary")
        primary.stop()  # its stream ends after all it sent: nothing is in flight
        wait_until(lambda: not standby.following, what="the stream's end")
        voter = TcpStore("127.0.0.2", standby.port, TOKEN)
        assert voter.promote("node-a", timeout=5)
        assert (voter.get("old").value, voter.get("new").value) == (None, b"2")
        voter.close()
    finally:
        standby.stop()
        primary.stop()


def test_a_fenced_store_answers_every_request_and_every_waiting_one_fenced() -> None:
    server = TcpStoreServer("127.0.0.1", 0, TOKEN).start()
    waiting = TcpStore("127.0.0.1", server.port, TOKEN)
    other = TcpStore("127.0.0.1", server.port, TOKEN)
    try:
        other.set("k", b"1")
        import threading

        outcome: list[BaseException] = []

        def wait() -> None:
            try:
                waiting.wait(["never"], 20)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(lambda: server._waiters.get("never"), what="the wait to park")
        server.fence()
        thread.join(10)
        assert outcome and isinstance(outcome[0], StoreFenced)
        with pytest.raises(StoreFenced):
            other.get("k")
        other.ping()  # still there, serving nobody
    finally:
        waiting.close()
        other.close()
        server.stop()


def test_a_standby_told_to_follow_another_primary_starts_afresh_from_it() -> None:
    old = TcpStoreServer("127.0.0.1", 0, TOKEN).start()
    new = TcpStoreServer("127.0.0.3", 0, TOKEN).start()
    standby = TcpStoreServer("127.0.0.2", 0, TOKEN).start()
    try:
        with TcpStore("127.0.0.1", old.port, TOKEN) as client:
            client.set("old", b"1")
        with TcpStore("127.0.0.3", new.port, TOKEN) as client:
            client.set("new", b"2")
        standby.follow("127.0.0.1", old.port, voters("node-a"))
        wait_until(lambda: standby.synced, what="the first primary's snapshot")
        standby.follow("127.0.0.3", new.port, voters("node-a"))  # the job's store moved there
        assert standby.primary == f"127.0.0.3:{new.port}"
        wait_until(lambda: standby.snapshots == 2, what="the new primary's snapshot")
        with TcpStore("127.0.0.3", new.port, TOKEN) as client:
            client.set("later", b"3")
        # The stream is asynchronous: a write the primary acknowledged reaches the standby after.
        wait_until(lambda: standby._state.get("later").value == b"3", what="the write streamed")
        with TcpStore("127.0.0.2", standby.port, TOKEN) as voter:
            wait_until(lambda: voter.promote("node-a", timeout=1), what="the promotion")
            assert voter.get("new").value == b"2" and voter.get("later").value == b"3"
            assert voter.get("old").value is None, "what the old primary held is gone"
    finally:
        for server in (old, new, standby):
            server.stop()
