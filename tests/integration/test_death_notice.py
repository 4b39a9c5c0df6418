"""A dead agent's death notice (``rendezvous.death_notice``): its guardian tells the store, and the
survivors re-form at once, with the default keep-alive (15 s of silence), on both backends."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from conftest import LeakCheck, wait_until
from test_rendezvous import Rendezvous, rendezvous_for, script
from test_spares_and_health import Node, start, stop_all

from relaunch.procs.guardian import Guardian
from relaunch.rendezvous.death_notice import DeathNotice
from relaunch.store.client import TcpStore
from relaunch.store.server import TcpStoreServer

pytestmark = pytest.mark.timeout(90)

#: Default heartbeats; the first round waits for both nodes (a long last call).
CONF = "last_call_timeout=30,join_timeout=60"

WORLD_UNTIL_ALONE = """
    import os, time
    print("world", os.environ["WORLD_SIZE"], flush=True)
    while os.environ["WORLD_SIZE"] == "2":
        time.sleep(60)
"""


@pytest.fixture(params=["c10d", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> Rendezvous:
    return rendezvous_for(request)


def test_a_sigkilled_agent_is_noticed_through_its_guardian_not_its_silence(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    job = script(tmp_path, WORLD_UNTIL_ALONE)
    flags = ("--nnodes", "1:2", "--rdzv-conf", CONF)
    nodes: list[Node] = []
    try:
        first = start(tmp_path, leaks, rdzv, "first", job, *flags)
        nodes.append(first)
        wait_until(rdzv.ready, what="the first agent to host the store")
        second = start(tmp_path, leaks, rdzv, "second", job, *flags)
        nodes.append(second)
        wait_until(lambda: first.stdout() and second.stdout(), 60, "a world of 2")
        second.proc.send_signal(signal.SIGKILL)  # not the first: on c10d it hosts the store
        second.wait()
        # Well before the heartbeats could tell (15 s of silence, checked every 5 s).
        wait_until(lambda: len(first.stdout()) == 2, 10, "the survivor's world of 1")
        assert first.wait() == 0, first.stderr()
    finally:
        stop_all(nodes)
    assert first.stdout() == ["world 2", "world 1"]
    # On etcd either node may have arrived first: its group rank is not known here.
    assert re.search(r"node of group rank [01] lost \(its agent died\)", first.stderr())


def test_an_agent_that_ends_by_itself_leaves_no_death_notice(
    tmp_path: Path, leaks: LeakCheck, rdzv: Rendezvous
) -> None:
    """Both nodes finish; the one that ends first leaves its exit barrier with the other, and
    no guardian says a node was lost."""
    job = script(tmp_path, "import os; print('world', os.environ['WORLD_SIZE'])\n")
    flags = ("--nnodes", "2", "--rdzv-conf", CONF)
    nodes: list[Node] = []
    try:
        nodes.append(start(tmp_path, leaks, rdzv, "first", job, *flags))
        wait_until(rdzv.ready, what="the first agent to host the store")
        nodes.append(start(tmp_path, leaks, rdzv, "second", job, *flags))
        assert [node.wait() for node in nodes] == [0, 0]
    finally:
        stop_all(nodes)
    for node in nodes:
        assert node.stdout() == ["world 2"]
        assert "lost" not in node.stderr(), node.stderr()


def test_the_guardian_writes_the_death_notice_at_its_launchers_end_unless_taken_back() -> None:
    server = TcpStoreServer("127.0.0.1", 0, "tok", expected_clients=4)
    server.start()
    guardians = [Guardian() for _ in range(3)]
    try:
        where = {"store": "c10d", "host": "127.0.0.1", "port": server.port, "token": "tok"}
        said, taken_back, late = (DeathNotice(where, g.set_death_notice) for g in guardians)
        said.leave("a/changed", "a/bell", b"lost")
        taken_back.leave("b/changed", "b/bell", b"lost")
        taken_back.retract()
        store = TcpStore("127.0.0.1", server.port, "tok")
        store.set("c/changed", b"restarting")  # the round had changed already
        late.leave("c/changed", "c/bell", b"lost")
        for guardian in guardians:
            guardian.close()
            assert guardian._proc.wait(timeout=10) == 0
        assert (store.get("a/changed").value, store.get("a/bell").value) == (b"lost", b"lost")
        assert store.get("b/changed").value is None
        assert (store.get("c/changed").value, store.get("c/bell").value) == (b"restarting", None)
        store.close()
    finally:
        for guardian in guardians:
            guardian.close()
        server.stop()


def test_a_death_notice_too_long_for_one_pipe_write_is_not_left() -> None:
    sent: list[str | None] = []
    notice = DeathNotice({"store": "c10d", "token": "t" * 5000}, sent.append)
    notice.leave("changed", "bell", b"lost")
    notice.retract()
    assert sent == []
    notice = DeathNotice({"store": "c10d", "token": "t"}, sent.append)
    notice.leave("changed", "bell", b"lost")
    notice.retract()
    assert len(sent) == 2 and sent[1] is None and '"record": "lost"' in str(sent[0])
