"""The real-etcd fixtures work: members start, serve the v3 gateway, fail over, and stop."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import uuid
from typing import Any

import etcd_cluster
import pytest
from conftest import MARK_VAR, pid_alive, wait_until
from etcd_cluster import EtcdCluster, b64, unb64

pytestmark = pytest.mark.timeout(60)


def put(
    cluster: EtcdCluster, key: str, value: str, member: int = 0, token: str | None = None
) -> dict[str, Any]:
    return cluster.call(
        "/v3/kv/put", {"key": b64(key), "value": b64(value)}, member=member, token=token
    )


def get(cluster: EtcdCluster, key: str, member: int = 0, token: str | None = None) -> str | None:
    reply = cluster.call("/v3/kv/range", {"key": b64(key)}, member=member, token=token)
    kvs = reply.get("kvs", [])  # absent, not empty, when nothing matches
    return unb64(kvs[0]["value"]).decode() if kvs else None


def error_of(error: urllib.error.HTTPError) -> tuple[int, dict[str, Any]]:
    """The status and etcd's error JSON, e.g. ``{"error": ..., "message": ..., "code": 16}``."""
    return error.code, json.loads(error.read())


def assert_stopped(pids: list[int], data_dir: str) -> None:
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not os.path.exists(data_dir)


def test_single_member_put_and_range(etcd: EtcdCluster) -> None:
    assert etcd.protocol == "http"
    assert etcd.endpoints == etcd.endpoint_list[0]
    host, port = etcd.endpoints.split(":")
    assert host == "127.0.0.1" and int(port) != 2379
    assert len(etcd.pids) == 1 and pid_alive(etcd.pids[0])

    reply = put(etcd, "greeting", "hello")
    assert int(reply["header"]["revision"]) >= 2  # int64 fields come as strings
    assert get(etcd, "greeting") == "hello"
    assert get(etcd, "no-such-key") is None

    pids, data_dir = etcd.pids, etcd.dir
    etcd.stop()
    assert_stopped(pids, data_dir)


def test_members_carry_no_test_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MARK_VAR, "should-not-be-inherited")
    with EtcdCluster() as cluster:
        with open(f"/proc/{cluster.pids[0]}/environ", "rb") as file:
            environ = file.read().split(b"\0")
        pids, data_dir = cluster.pids, cluster.dir
    assert not [entry for entry in environ if entry.startswith(MARK_VAR.encode())]
    assert_stopped(pids, data_dir)


def test_shared_member_serves_the_session(etcd_shared: EtcdCluster) -> None:
    key = f"fixture-test/{uuid.uuid4().hex}"
    put(etcd_shared, key, "shared")
    assert get(etcd_shared, key) == "shared"


def test_three_members_survive_losing_the_leader(etcd3: EtcdCluster) -> None:
    assert len(etcd3.endpoint_list) == 3
    assert etcd3.endpoints == ",".join(etcd3.endpoint_list)
    assert len(set(etcd3.endpoint_list)) == 3
    put(etcd3, "survivor", "yes", member=0)

    leader = etcd3.leader()
    assert leader is not None
    etcd3.kill(leader)
    assert not pid_alive(etcd3.pids[leader])
    survivors = [i for i in range(3) if i != leader]
    assert all(pid_alive(etcd3.pids[i]) for i in survivors)

    seen: list[str | None] = []

    def readable_from_a_survivor() -> bool:
        try:  # a linearizable read: it fails or waits while the survivors elect a new leader
            seen.append(get(etcd3, "survivor", member=survivors[0]))
        except OSError:
            return False
        return True

    wait_until(readable_from_a_survivor, timeout=10, what="a read after losing the leader")
    assert seen[-1] == "yes"
    assert etcd3.leader() in survivors
    put(etcd3, "after", "failover", member=survivors[1])
    assert get(etcd3, "after", member=survivors[0]) == "failover"

    pids, data_dir = etcd3.pids, etcd3.dir
    etcd3.stop()
    assert_stopped(pids, data_dir)


def test_tls_and_auth() -> None:
    with EtcdCluster(tls=True, auth=("root", "pw")) as cluster:
        assert cluster.protocol == "https"
        for path in (cluster.cacert, cluster.cert, cluster.key):
            assert os.path.isfile(path)

        with pytest.raises(urllib.error.HTTPError) as unauthenticated:
            get(cluster, "x")
        code, body = error_of(unauthenticated.value)
        assert code == 403 and "permission denied" in body["error"]

        with pytest.raises(urllib.error.HTTPError) as bad_token:
            get(cluster, "x", token="not-a-token")
        code, body = error_of(bad_token.value)
        assert code == 401 and "invalid auth token" in body["error"]

        with pytest.raises(urllib.error.HTTPError) as bad_password:
            cluster.call("/v3/auth/authenticate", {"name": "root", "password": "wrong"})
        code, body = error_of(bad_password.value)
        assert code == 400 and "authentication failed" in body["error"]

        token = cluster.authenticate()
        put(cluster, "x", "secret", token=token)
        assert get(cluster, "x", token=token) == "secret"

        pids, data_dir = cluster.pids, cluster.dir
    assert_stopped(pids, data_dir)


def test_plain_auth_refuses_requests_without_a_token() -> None:
    with EtcdCluster(auth=("root", "pw")) as cluster:
        with pytest.raises(urllib.error.HTTPError) as unauthenticated:
            get(cluster, "x")
        code, body = error_of(unauthenticated.value)
        assert code == 400 and "user name is empty" in body["error"]
        assert get(cluster, "x", token=cluster.authenticate()) is None
        pids, data_dir = cluster.pids, cluster.dir
    assert_stopped(pids, data_dir)


def test_start_retries_on_a_port_clash(monkeypatch: pytest.MonkeyPatch) -> None:
    free_ports = etcd_cluster._free_ports
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        clash = [[taken.getsockname()[1], *free_ports(1)]]  # the first pick only

        def pick(count: int) -> list[int]:
            return clash.pop() if clash else free_ports(count)

        monkeypatch.setattr(etcd_cluster, "_free_ports", pick)
        with EtcdCluster() as cluster:
            assert not clash and cluster.client_ports[0] != taken.getsockname()[1]
            put(cluster, "k", "v")
            assert get(cluster, "k") == "v"


def test_a_failed_start_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(etcd_cluster, "_free_ports", lambda n: [port, port + 1])
        with pytest.raises(RuntimeError, match="address already in use"):
            EtcdCluster().start()
