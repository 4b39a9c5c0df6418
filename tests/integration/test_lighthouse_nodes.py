"""The job's lighthouse on several nodes (``agent.lighthouse_nodes``), on the built-in store for
real: two nodes' parts, each over its own ``kinds_c10d.C10dSeat``, a primary store and a standby
following it (``store.replication``), each node's ``StoreFailover``. The store's host runs the
lighthouse; when the store moves to the standby (a real promotion, voted by the last round's
member), the node it moved to starts one, and torchft's own client, given that node's relay
once, reaches it.

The agents' own failover needs a majority of the job's members alive (every group's:
``failover_groups``), which two replica groups of one node lose with the host: the promotion is
asked here as a surviving member asks it, naming its group."""

from __future__ import annotations

import json
import logging
import os
import signal
from datetime import timedelta
from typing import Any

import pytest
from conftest import MARK_VAR, LeakCheck, wait_until
from test_lighthouse import EXTENSION, torchft_client_module

from relaunch.agent.lighthouse_nodes import NodeLighthouse
from relaunch.core.run.lighthouse import KEY_NAME, LighthouseSettings
from relaunch.endpoints import find_free_port
from relaunch.rendezvous.failover import StoreFailover, job_electorate, voter_name
from relaunch.rendezvous.kinds_c10d import C10dSeat
from relaunch.rendezvous.rounds import job_key
from relaunch.store.client import TcpStore
from relaunch.store.server import TcpStoreServer

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(EXTENSION is None, reason="torchft is not installed"),
]
TOKEN = "lighthouse-token"
GROUP_RUN_ID = "job-group0"  # the rendezvous of the group whose member votes
KEY = job_key("job", KEY_NAME)


@pytest.fixture
def marked(leaks: LeakCheck, monkeypatch: pytest.MonkeyPatch) -> LeakCheck:
    monkeypatch.setenv(MARK_VAR, leaks.mark)
    return leaks


def quorum_through(address: str, replica: str, client: Any = None) -> list[str]:
    client = client or torchft_client_module().LighthouseClient(address, timedelta(seconds=10))
    got = client.quorum(replica_id=replica, timeout=timedelta(seconds=10), world_size=1)
    return [member.replica_id for member in got.participants]


def test_the_stores_host_runs_it_and_the_node_the_store_moved_to_runs_the_next(
    marked: LeakCheck, tmp_path: Any
) -> None:
    port = find_free_port("127.0.0.1")
    endpoints = [("127.0.0.1", port), ("127.0.0.2", port)]
    elect = job_electorate(GROUP_RUN_ID)
    primary = TcpStoreServer("127.0.0.1", port, TOKEN).start()
    standby = TcpStoreServer("127.0.0.2", port, TOKEN).start()
    standby.follow("127.0.0.1", port, elect)
    servers = (primary, standby)
    failovers = [StoreFailover(endpoints, TOKEN, endpoints[0], server, elect) for server in servers]
    seats = [
        C10dSeat(endpoints[0], TOKEN, 10.0, server, failover, host)
        for server, failover, (host, _) in zip(servers, failovers, endpoints, strict=True)
    ]
    nodes = [
        NodeLighthouse(seat, KEY, LighthouseSettings(), str(tmp_path / f"node{n}"))
        for n, seat in enumerate(seats)
    ]
    for n in range(2):
        (tmp_path / f"node{n}").mkdir()
    try:
        # The last round completed, in the group's rendezvous: one member (it votes below).
        with TcpStore("127.0.0.1", port, TOKEN, timeout=5) as store:
            store.set(job_key(GROUP_RUN_ID, "round"), b"1")
            store.set(job_key(GROUP_RUN_ID, "final", 1), json.dumps({"count": 1}).encode())
        wait_until(lambda: standby.synced, 10, "the standby's snapshot")
        addresses = [node.start()["TORCHFT_LIGHTHOUSE"] for node in nodes]
        first = nodes[0].lighthouse
        assert first is not None and nodes[1].lighthouse is None
        wait_until(
            lambda: all(node.relay.target == ("127.0.0.1", first.port) for node in nodes),
            10,
            "the relays",
        )
        client = torchft_client_module().LighthouseClient(addresses[1], timedelta(seconds=10))
        assert quorum_through(addresses[1], "group1", client) == ["group1"]

        # Its lighthouse killed: the next one, on a new port past the last quorum id, is
        # written under the key, and the relays follow it there.
        old_port, pid = first.port, first.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: first.restarts == 1, 10, "the lighthouse restarted")
        assert first.port != old_port
        wait_until(
            lambda: all(node.relay.target == ("127.0.0.1", first.port) for node in nodes),
            10,
            "the relays follow the restarted one",
        )
        got = client.quorum(replica_id="group1", timeout=timedelta(seconds=10), world_size=1)
        assert got.quorum_id == 2  # past the last one's, 1

        nodes[0].close()  # the store's host is lost: its lighthouse and its store go
        primary.stop()
        moved = failovers[1].take_over(voter_name(1, 0, GROUP_RUN_ID), 10.0)
        assert moved == endpoints[1]
        wait_until(lambda: nodes[1].lighthouse is not None, 15, "node 1 to run the lighthouse")
        second = nodes[1].lighthouse
        assert second is not None and second.host == "127.0.0.2"
        wait_until(
            lambda: nodes[1].relay.target == ("127.0.0.2", second.port), 15, "the relay moved"
        )
        # The same client, given node 1's relay once, reaches the new lighthouse.
        assert quorum_through(addresses[1], "group1", client) == ["group1"]
        with TcpStore("127.0.0.2", port, TOKEN, timeout=5) as store:
            assert store.get(KEY).value == f"127.0.0.2:{second.port}".encode()
    finally:
        for node in nodes:
            node.close()
        for failover in failovers:
            failover.close()
        primary.stop()
        standby.stop()


def test_a_node_that_does_not_host_the_store_only_relays(
    marked: LeakCheck, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Hostile: a forged address under the job's key reaches no relay (said in one line)."""
    server = TcpStoreServer("127.0.0.1", 0, TOKEN).start()
    seat = C10dSeat(("127.0.0.1", server.port), TOKEN, 10.0, None, None, "127.0.0.2")
    node = NodeLighthouse(seat, KEY, LighthouseSettings(), str(tmp_path))
    try:
        node.start()
        assert node.lighthouse is None
        with (
            caplog.at_level(logging.WARNING),
            TcpStore("127.0.0.1", server.port, TOKEN, timeout=5) as store,
        ):
            store.set(KEY, b"evil.example:99999")
            wait_until(lambda: "no HOST:PORT" in caplog.text, 10, "the forged address said")
            assert node.relay.target is None
            store.set(KEY, b"127.0.0.1:1")
            wait_until(lambda: node.relay.target == ("127.0.0.1", 1), 10, "a good address")
    finally:
        node.close()
        server.stop()
