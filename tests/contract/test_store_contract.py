"""One suite every Store backend passes: in-memory, built-in TCP (with and without a token),
and etcd (a real member, and a real 3-member cluster reached through all its endpoints)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from relaunch.store import (
    EtcdStore,
    MemoryStore,
    Store,
    StoreError,
    StoreTimeout,
    TcpStore,
    TcpStoreServer,
    Versioned,
)

pytestmark = pytest.mark.timeout(60)

StoreFactory = Callable[[], Store]


@pytest.fixture(params=["memory", "tcp", "tcp-token", "etcd", "etcd-cluster"])
def connect(request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    """A factory of clients that all talk to one fresh store."""
    if request.param == "memory":
        shared = MemoryStore()
        yield lambda: shared
        return
    if request.param.startswith("etcd"):
        cluster = request.getfixturevalue("etcd_shared" if request.param == "etcd" else "etcd3")
        cluster.call("/v3/kv/deleterange", {"key": "AA==", "range_end": "AA=="})  # all keys
        stores: list[EtcdStore] = []

        def new_etcd_client() -> Store:
            # Each client starts at another member: the cluster's members must agree.
            endpoints = cluster.endpoint_list[len(stores) % len(cluster.endpoint_list) :]
            stores.append(EtcdStore(endpoints + cluster.endpoint_list, timeout=10))
            return stores[-1]

        yield new_etcd_client
        for store in stores:
            store.close()
        return
    token = "t0ken" if request.param == "tcp-token" else None
    server = TcpStoreServer(token=token).start()
    clients: list[TcpStore] = []

    def new_client() -> Store:
        client = TcpStore("127.0.0.1", server.port, token=token, timeout=10)
        clients.append(client)
        return client

    yield new_client
    for client in clients:
        client.close()
    server.stop()


def test_absent_keys_read_as_none_with_version_0(connect: StoreFactory) -> None:
    assert connect().get("nothing") == Versioned(None, 0)


def test_set_bumps_the_version_and_keeps_bytes_exactly(connect: StoreFactory) -> None:
    store = connect()
    every_byte = bytes(range(256)) * 4
    first = store.set("k", every_byte)
    second = store.set("other", b"")
    assert 0 < first < second
    assert store.get("k") == Versioned(every_byte, first)
    assert store.get("other") == Versioned(b"", second)


def test_compare_set_writes_only_at_the_expected_version(connect: StoreFactory) -> None:
    store = connect()
    created = store.compare_set("k", 0, b"a")
    assert created.succeeded and created.current.value == b"a"
    assert not store.compare_set("k", 0, b"b").succeeded
    stale = store.compare_set("k", created.current.version + 100, b"c")
    assert not stale.succeeded and stale.current == created.current
    updated = store.compare_set("k", created.current.version, b"d")
    assert updated.succeeded and updated.current.version > created.current.version
    assert store.get("k").value == b"d"


def test_add_counts_from_zero_and_refuses_non_integers(connect: StoreFactory) -> None:
    store = connect()
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n").value == b"-2"
    store.set("text", b"hello")
    with pytest.raises(StoreError, match="integer"):
        store.add("text", 1)


def test_delete(connect: StoreFactory) -> None:
    store = connect()
    store.set("k", b"v")
    assert store.delete("k") is True
    assert store.delete("k") is False
    assert store.get("k") == Versioned(None, 0)


def test_wait_returns_once_every_key_exists(connect: StoreFactory) -> None:
    waiter, writer = connect(), connect()
    writer.set("a", b"1")
    waiter.wait(["a"], timeout=1)  # already there
    started = threading.Event()

    def write_later() -> None:
        started.wait(10)
        writer.set("b", b"2")

    thread = threading.Thread(target=write_later)
    thread.start()
    started.set()
    waiter.wait(["a", "b"], timeout=10)
    thread.join()
    assert waiter.get("b").value == b"2"


def test_wait_times_out_naming_the_missing_keys(connect: StoreFactory) -> None:
    store = connect()
    store.set("here", b"")
    with pytest.raises(StoreTimeout, match="gone"):
        store.wait(["here", "gone"], timeout=0.1)
    store.set("after", b"ok")  # the store is still usable after a timeout
    assert store.get("after").value == b"ok"


def test_watch_returns_on_a_change_or_as_is_at_the_timeout(connect: StoreFactory) -> None:
    watcher, writer = connect(), connect()
    version = writer.set("k", b"old")
    assert watcher.watch("k", version, timeout=0.05) == Versioned(b"old", version)
    assert watcher.watch("k", 0, timeout=5).value == b"old"  # already different: at once
    thread = threading.Thread(target=lambda: writer.set("k", b"new"))
    thread.start()
    changed = watcher.watch("k", version, timeout=10)
    thread.join()
    assert changed.value == b"new" and changed.version > version


def test_concurrent_compare_set_has_exactly_one_winner(connect: StoreFactory) -> None:
    clients = [connect() for _ in range(8)]
    version = clients[0].set("leader", b"none")
    wins: list[int] = []
    barrier = threading.Barrier(len(clients))

    def contend(index: int) -> None:
        barrier.wait(10)
        if clients[index].compare_set("leader", version, str(index).encode()).succeeded:
            wins.append(index)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1
    assert clients[0].get("leader").value == str(wins[0]).encode()


def test_concurrent_adds_are_all_counted(connect: StoreFactory) -> None:
    clients = [connect() for _ in range(4)]

    def add_many(store: Store) -> None:
        for _ in range(50):
            store.add("total", 1)

    threads = [threading.Thread(target=add_many, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clients[0].get("total").value == b"200"


def test_a_value_too_large_to_return_is_refused(connect: StoreFactory) -> None:
    from relaunch.store.wire import MAX_VALUE

    store = connect()
    if not isinstance(store, TcpStore):
        pytest.skip("only the built-in TCP store has frames to fit in")
    with pytest.raises(StoreError, match="exceeds the limit"):
        store.set("big", b"x" * (MAX_VALUE + 1))
    store.set("fits", b"x" * MAX_VALUE)
    assert len(store.get("fits").value or b"") == MAX_VALUE


def test_many_keys_read_at_once_read_as_one_by_one(connect: StoreFactory) -> None:
    """The lead of a round reads every member's record so (``rendezvous.roster.get_many``): on
    the built-in store one request per ``wire.MAX_GETS`` keys; on etcd one read each."""
    from relaunch.rendezvous.roster import get_many

    store = connect()
    keys = [f"many/{n}" for n in range(200)]
    for n in range(0, 200, 3):
        store.set(keys[n], str(n).encode())
    assert get_many(store, keys) == [store.get(key) for key in keys]
    assert get_many(store, []) == []
