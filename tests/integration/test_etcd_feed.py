"""The etcd feed (``store/etcd_feed.py``): one watch a node over the job's news, against a real
etcd: what it sees, how it waits, a member dying under it, a compaction, and its end."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest
from etcd_cluster import EtcdCluster

from relaunch.store.api import StoreConnectionError, Versioned
from relaunch.store.etcd import EtcdStore
from relaunch.store.etcd_feed import PrefixFeed

pytestmark = pytest.mark.timeout(60)


def feed_of(endpoints: str, idle: float = 5.0, timeout: float = 10.0) -> tuple[PrefixFeed, str]:
    prefix = f"feed-{uuid.uuid4().hex}/news/"
    feed = PrefixFeed(EtcdStore(endpoints, timeout=timeout), prefix, idle)
    feed.start()
    return feed, prefix


class Followed(NamedTuple):
    """A started feed of a fresh prefix, and a store of its own that writes there."""

    feed: PrefixFeed
    prefix: str
    writer: EtcdStore


@pytest.fixture
def followed(etcd_shared: EtcdCluster) -> Iterator[Followed]:
    feed, prefix = feed_of(etcd_shared.endpoints)
    writer = EtcdStore(etcd_shared.endpoints)
    try:
        yield Followed(feed, prefix, writer)
    finally:
        feed.close()
        writer.close()


def test_the_feed_serves_every_write_after_its_start_without_a_request(
    followed: Followed,
) -> None:
    feed, prefix, writer = followed
    before = f"feed-{uuid.uuid4().hex}/news/early"
    writer.set(before, b"0")
    version = writer.set(f"{prefix}final", b"record")
    seen = feed.watch(f"{prefix}final", 0, 5.0)
    assert seen == Versioned(b"record", version)
    assert feed.get(f"{prefix}final") == seen  # from memory
    assert feed.get(before) == Versioned(None, 0)  # not under the prefix
    writer.set(f"{prefix}bell", b"ring")
    writer.delete(f"{prefix}final")
    assert feed.watch(f"{prefix}final", version, 5.0) == Versioned(None, 0)
    assert feed.watch(f"{prefix}bell", 0, 5.0).value == b"ring"
    feed.forget(prefix)
    assert feed.get(f"{prefix}bell") == Versioned(None, 0)


def test_a_watch_of_the_feed_wakes_on_the_write_and_returns_at_its_timeout(
    followed: Followed,
) -> None:
    feed, prefix, writer = followed
    started = time.monotonic()
    assert feed.watch(f"{prefix}bell", 0, 0.3) == Versioned(None, 0)
    assert time.monotonic() - started >= 0.3
    seen: list[Versioned] = []
    waiter = threading.Thread(target=lambda: seen.append(feed.watch(f"{prefix}bell", 0, 20)))
    waiter.start()
    written_at = time.monotonic()
    writer.set(f"{prefix}bell", b"ring")
    waiter.join(20)
    assert seen and seen[0].value == b"ring"
    assert time.monotonic() - written_at < 5.0  # woken by the write, not the timeout


def test_a_subscriber_hears_its_key_at_once_then_at_each_write_until_it_leaves(
    followed: Followed,
) -> None:
    feed, prefix, writer = followed
    heard: list[Versioned] = []
    changed = threading.Condition()

    def hear(value: Versioned) -> None:
        with changed:
            heard.append(value)
            changed.notify_all()

    def wait_heard(count: int) -> list[Versioned]:
        with changed:
            assert changed.wait_for(lambda: len(heard) >= count, 10), heard
            return list(heard)

    first = writer.set(f"{prefix}bell", b"one")
    assert feed.watch(f"{prefix}bell", 0, 10).version == first
    leave = feed.subscribe(f"{prefix}bell", hear, lambda exc: None)
    assert wait_heard(1) == [Versioned(b"one", first)]  # already rung: heard at once
    writer.set(f"{prefix}other", b"-")
    second = writer.set(f"{prefix}bell", b"two")
    writer.delete(f"{prefix}bell")
    assert wait_heard(3)[1:] == [Versioned(b"two", second), Versioned(None, 0)]
    leave()
    last = writer.set(f"{prefix}bell", b"three")
    assert feed.watch(f"{prefix}bell", 0, 10).version == last
    assert len(heard) == 3  # the feed had it, the subscriber had left


def test_the_feed_follows_on_another_member_when_its_member_dies(etcd3: EtcdCluster) -> None:
    feed, prefix = feed_of(etcd3.endpoints)
    on = etcd3.endpoint_list.index(str(feed._store.member))
    others = [e for i, e in enumerate(etcd3.endpoint_list) if i != on]
    writer = EtcdStore(",".join(others))
    try:
        first = writer.set(f"{prefix}r0/final", b"0")
        assert feed.watch(f"{prefix}r0/final", 0, 10).version == first
        etcd3.kill(on)
        later = writer.set(f"{prefix}r1/final", b"1")
        assert feed.watch(f"{prefix}r1/final", 0, 20) == Versioned(b"1", later)
    finally:
        feed.close()
        writer.close()


def test_a_stream_behind_a_compaction_reads_the_prefix_whole(
    etcd_shared: EtcdCluster, followed: Followed
) -> None:
    """A stream that must follow on from a revision etcd compacted away: the feed reads what is
    under the prefix now (here its stream is broken by hand, set to follow on from before the
    compaction, and made to forget what it saw)."""
    feed, prefix, writer = followed
    behind = writer.set(f"{prefix}r0/bell", b"old")
    writer.delete(f"{prefix}r0/bell")
    now = writer.set(f"{prefix}r0/final", b"now")
    assert feed.watch(f"{prefix}r0/final", 0, 10).version == now
    etcd_shared.call("/v3/kv/compaction", {"revision": str(now)})
    heard: list[Versioned] = []
    feed.subscribe(f"{prefix}r0/final", heard.append, lambda exc: None)
    feed.forget(prefix)
    feed._revision = behind - 1
    assert feed._stream is not None
    feed._stream.interrupt()
    assert feed.watch(f"{prefix}r0/final", 0, 10) == Versioned(b"now", now)
    assert feed.get(f"{prefix}r0/bell") == Versioned(None, 0)
    assert heard == [Versioned(b"now", now)] * 2  # at once, and again on reading it whole
    later = writer.set(f"{prefix}r1/final", b"later")  # and it follows on from there
    assert feed.watch(f"{prefix}r1/final", 0, 10).version == later


def test_a_feed_whose_cluster_is_gone_says_so_to_its_waiters(etcd: EtcdCluster) -> None:
    feed, prefix = feed_of(etcd.endpoints, timeout=1.0)
    lost: list[Exception] = []
    feed.subscribe(f"{prefix}bell", lambda value: None, lost.append)
    try:
        etcd.kill(0)
        with pytest.raises(StoreConnectionError, match="cannot watch"):
            feed.watch(f"{prefix}bell", 0, 20)
        assert len(lost) == 1 and "cannot watch" in str(lost[0])
    finally:
        feed.close()


def test_closing_the_feed_ends_its_thread(etcd_shared: EtcdCluster) -> None:
    feed, _ = feed_of(etcd_shared.endpoints)
    thread = feed._thread
    assert thread is not None and thread.is_alive()
    feed.close()
    thread.join(5)
    assert not thread.is_alive()
