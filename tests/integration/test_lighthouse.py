"""torchft's lighthouse kept alive by relaunch, for real: torchft 0.2.0's own server, reached by
its own client (``LighthouseClient``) and its status page; SIGKILLed and back on the same
address; none where one is given or torchft is missing; gone with the launcher."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
from conftest import MARK_VAR, LeakCheck, pid_alive, wait_until

from relaunch.agent.lighthouse import (
    Lighthouse,
    LighthouseError,
    start_if_wanted,
    torchft_extension,
)
from relaunch.agent.lighthouse_relay import LighthouseRelay
from relaunch.core.run.lighthouse import KEY_NAME, LighthouseSettings, announcement
from relaunch.rendezvous.rounds import job_key
from relaunch.store.memory import MemoryStore

EXTENSION = torchft_extension()
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(EXTENSION is None, reason="torchft is not installed"),
]
SRC = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["relaunch"].__file__ or "")))


@pytest.fixture
def marked(leaks: LeakCheck, monkeypatch: pytest.MonkeyPatch) -> LeakCheck:
    """The leak mark in this process's environment, so every lighthouse it starts carries it."""
    monkeypatch.setenv(MARK_VAR, leaks.mark)
    return leaks


def torchft_client_module() -> ModuleType:
    """torchft's extension, loaded by its path as the lighthouse loads it (torch stays out)."""
    if "_torchft" not in sys.modules:
        assert EXTENSION is not None
        spec = importlib.util.spec_from_file_location("_torchft", EXTENSION)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_torchft"] = module
    return sys.modules["_torchft"]


def quorum(address: str, replica: str = "group0") -> Any:
    """A quorum asked of the lighthouse at ``address`` by torchft's own client."""
    client = torchft_client_module().LighthouseClient(address, timedelta(seconds=10))
    return client.quorum(replica_id=replica, timeout=timedelta(seconds=10), world_size=1)


def status_page(address: str) -> str:
    with urllib.request.urlopen(address + "/status", timeout=10) as reply:
        return str(reply.read().decode())


def test_it_starts_with_the_settings_asked_and_torchfts_client_gets_a_quorum(
    marked: LeakCheck, tmp_path: Any
) -> None:
    lines: list[str] = []
    settings = LighthouseSettings(1, heartbeat_timeout_ms=1500, join_timeout_ms=400)
    lighthouse = Lighthouse(settings, str(tmp_path / "lighthouse.log"), say=lines.append)
    try:
        address = lighthouse.start()
        assert address == f"http://127.0.0.1:{lighthouse.port}"
        assert lighthouse.environment() == {"TORCHFT_LIGHTHOUSE": address}
        with open(f"/proc/{lighthouse.pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().decode().split("\0")[:-1]
        assert argv[argv.index("--bind") :] == [
            "--bind", "127.0.0.1:0", "--min_replicas", "1",
            "--heartbeat_timeout_ms", "1500", "--join_timeout_ms", "400",
            "--quorum_tick_ms", "20",
        ]  # fmt: skip
        got = quorum(address)
        assert [member.replica_id for member in got.participants] == ["group0"]
        assert "Current quorum_id" in status_page(address)
    finally:
        lighthouse.close()
    assert lines == []
    assert "Lighthouse listening on" in (tmp_path / "lighthouse.log").read_text()


def test_a_group_gone_holds_up_the_survivors_quorum_for_the_heartbeat_timeout(
    marked: LeakCheck, tmp_path: Any
) -> None:
    """Two groups heartbeat every 100 ms as torchft's Manager does; one stops: the survivor's
    next quorum comes once its heartbeats are 500 ms old (torchft's default: 5 s)."""
    lighthouse = Lighthouse(LighthouseSettings(), str(tmp_path / "lh.log"))
    beating = {"group0": threading.Event(), "group1": threading.Event()}
    client = torchft_client_module().LighthouseClient

    def heartbeat(group: str) -> None:
        beats = client(lighthouse.address, timedelta(seconds=10))
        while not beating[group].wait(0.1):
            beats.heartbeat(group)

    threads = [threading.Thread(target=heartbeat, args=(group,)) for group in beating]
    try:
        address = lighthouse.start()
        for thread in threads:
            thread.start()
        page = lambda: status_page(address).split("Heartbeats")[-1]  # noqa: E731
        wait_until(lambda: "group0" in page() and "group1" in page(), 10, "both heartbeat")
        asked = [threading.Thread(target=quorum, args=(address, group)) for group in beating]
        for thread in asked:
            thread.start()
        for thread in asked:
            thread.join(20)
        beating["group1"].set()
        gone_at = time.monotonic()
        got = quorum(address, "group0")
        held_up = time.monotonic() - gone_at
        assert [member.replica_id for member in got.participants] == ["group0"]
        assert 0.35 < held_up < 2.0, held_up
    finally:
        for stop in beating.values():
            stop.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(10)
        lighthouse.close()


def together(address: str, *replicas: str) -> list[Any]:
    """One quorum asked by each of ``replicas`` together (torchft's own client, a thread each).

    The last asks first, and each asks once the lighthouse holds the requests of those after
    it: the replicas of the last quorum, first in ``replicas``, would get a quorum at once
    without a newcomer that had not asked yet (on a loaded machine the threads' requests can
    come that far apart)."""
    got: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda r=replica: got.update({r: quorum(address, r)}))
        for replica in replicas
    ]
    for asked, thread in enumerate(reversed(threads), 1):
        thread.start()
        if asked < len(threads):
            wait_until(
                lambda n=asked: f"only have {n} participants" in status_page(address),
                10,
                f"the lighthouse holds {asked} request(s)",
            )
    for thread in threads:
        thread.join(20)
    return [got[replica] for replica in replicas]


def blocked_signals(pid: int) -> int:
    """The mask of signals process ``pid``'s main thread blocks."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1], 16) for line in status if line.startswith("SigBlk:"))


def test_a_sigkilled_lighthouse_is_back_behind_the_same_address_past_its_last_quorum_id(
    marked: LeakCheck, tmp_path: Any
) -> None:
    """torchft names each quorum's store prefix by its id: a restarted lighthouse, which counts
    from 1, must not give an id used before (gloo would read a dead peer's address there). The
    new one, on a new port, is driven past the last id before the relay in front of it, the
    workers' address, forwards to it; its first quorum waits for every group of the last."""
    lines: list[str] = []
    lighthouse = Lighthouse(
        LighthouseSettings(), str(tmp_path / "lh.log"), say=lines.append, front=LighthouseRelay()
    )
    try:
        address = lighthouse.start()
        assert lighthouse.front is not None and address == lighthouse.front.address
        assert lighthouse.environment() == {"TORCHFT_LIGHTHOUSE": address}
        assert [q.quorum_id for q in together(address, "group0")] == [1]
        assert [q.quorum_id for q in together(address, "group0", "group1")] == [2, 2]
        first, port = lighthouse.pid, lighthouse.port
        assert first is not None
        killed_at = time.monotonic()
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: lighthouse.restarts == 1, 10, "the lighthouse restarted")
        back_in = time.monotonic() - killed_at
        assert back_in < 2.0, back_in
        assert lighthouse.port != port and lighthouse.pid not in (None, first)
        assert lighthouse.address == address and not pid_alive(first)
        assert blocked_signals(lighthouse.pid) == 0  # started by a thread that blocks some
        # The same groups again: the quorum the drive left is theirs, with an id past 2.
        again = together(address, "group0", "group1")
        assert {q.quorum_id for q in again} == {3}
        assert [m.replica_id for m in again[0].participants] == ["group0", "group1"]
        assert lines[0] == (
            f"torchft's lighthouse (pid {first}) killed by SIGKILL (signal 9); "
            "restarting it at once"
        )
        assert lines[1].startswith(f"torchft's lighthouse is back on {address} after ")
        assert lines[1].endswith(", its quorum ids past 2")
        assert len(lines) == 2
        assert "relaunch: quorum id driven past 2 to 3" in (tmp_path / "lh.log").read_text()
    finally:
        lighthouse.close()
    assert lighthouse.front is not None and lighthouse.front.open_connections == 0


def test_without_a_front_a_restarted_lighthouse_says_its_new_port(
    marked: LeakCheck, tmp_path: Any
) -> None:
    moves: list[int | None] = []
    lighthouse = Lighthouse(LighthouseSettings(), str(tmp_path / "lh.log"), on_move=moves.append)
    try:
        first = lighthouse.start()
        quorum(first)
        pid, port = lighthouse.pid, lighthouse.port
        assert pid is not None and moves == []
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: lighthouse.restarts == 1, 10, "the lighthouse restarted")
        assert moves == [None, lighthouse.port] and lighthouse.port != port
        assert lighthouse.address == f"http://127.0.0.1:{lighthouse.port}"
        assert quorum(lighthouse.address).quorum_id == 2  # past the last one, 1
    finally:
        lighthouse.close()


def test_a_lighthouse_that_keeps_dying_backs_off_and_shows_its_log(
    marked: LeakCheck, tmp_path: Any
) -> None:
    lines: list[str] = []
    log_path = str(tmp_path / "lh.log")
    lighthouse = Lighthouse(LighthouseSettings(), log_path, say=lines.append)
    try:
        lighthouse.start()
        for restarts in (1, 2, 3):
            pid = lighthouse.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda n=restarts: lighthouse.restarts == n, 10, "the restart")
        deaths = [line for line in lines if "restarting it" in line]
        assert [line.split("restarting it")[1] for line in deaths] == [
            " at once",
            " in 0.25s (2 deaths in a row)",
            " in 0.5s (3 deaths in a row)",
        ]
        shown = [line for line in lines if line.startswith("its log")]
        assert len(shown) == 1 and shown[0].startswith(f"its log ({log_path}) begins: ")
        assert "Lighthouse listening on" in shown[0]
        assert lighthouse.address is not None
        quorum(lighthouse.address)
    finally:
        lighthouse.close()


def test_close_stops_it_reaps_it_and_frees_the_port(marked: LeakCheck, tmp_path: Any) -> None:
    lighthouse = Lighthouse(LighthouseSettings(), str(tmp_path / "lh.log"))
    lighthouse.start()
    pid, port = lighthouse.pid, lighthouse.port
    assert pid is not None and port is not None
    lighthouse.close()
    assert not pid_alive(pid)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped already
    again = Lighthouse(LighthouseSettings(), str(tmp_path / "lh2.log"), port=port)
    try:
        assert again.start() == f"http://127.0.0.1:{port}"  # the port binds again at once
    finally:
        again.close()


def test_a_lighthouse_that_cannot_start_says_why(marked: LeakCheck, tmp_path: Any) -> None:
    not_an_extension = tmp_path / "_torchft.so"
    not_an_extension.write_text("no machine code here\n")
    log_path = str(tmp_path / "lh.log")
    lighthouse = Lighthouse(LighthouseSettings(), log_path, extension=str(not_an_extension))
    try:
        with pytest.raises(LighthouseError) as raised:
            lighthouse.start()
    finally:
        lighthouse.close()
    assert str(raised.value) == (
        f"torchft's lighthouse did not start: it exited with code 1 before it listened "
        f"(its log: {log_path})"
    )
    assert "ImportError" in (tmp_path / "lh.log").read_text()


def test_start_if_wanted_starts_one_unless_an_address_is_given(
    marked: LeakCheck, tmp_path: Any
) -> None:
    given = {"TORCHFT_LIGHTHOUSE": "http://elsewhere:29510"}
    assert start_if_wanted(given, 2, str(tmp_path)) is None
    assert start_if_wanted({}, None, str(tmp_path)) is None
    assert not (tmp_path / "lighthouse.log").exists()
    lines: list[str] = []
    environ = {"RELAUNCH_LIGHTHOUSE_QUORUM_TICK_MS": "x"}
    lighthouse = start_if_wanted(environ, 2, str(tmp_path), min_replicas=2, say=lines.append)
    assert lighthouse is not None
    try:
        assert lighthouse.settings == LighthouseSettings(2)
        assert lines == [
            "RELAUNCH_LIGHTHOUSE_QUORUM_TICK_MS='x' is not a whole number of milliseconds "
            "in 1..86400000; using 20"
        ]
        assert "Current quorum_id" in status_page(lighthouse.environment()["TORCHFT_LIGHTHOUSE"])
    finally:
        lighthouse.close()


def test_without_torchft_none_starts(marked: LeakCheck, tmp_path: Any) -> None:
    # -S: no site-packages, where torchft is installed; relaunch itself comes from PYTHONPATH.
    program = (
        "import sys; from relaunch.agent.lighthouse import start_if_wanted, torchft_importable;"
        "print(torchft_importable(), start_if_wanted({}, 2, sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        env=marked.process_env(PYTHONPATH=SRC),
        timeout=30,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "False None\n", "")
    assert not (tmp_path / "lighthouse.log").exists()


LAUNCHER = """
import sys
from relaunch.agent.lighthouse import Lighthouse
from relaunch.core.run.lighthouse import LighthouseSettings
lighthouse = Lighthouse(LighthouseSettings(), sys.argv[1])
lighthouse.start()
print(lighthouse.pid, flush=True)
sys.stdin.read()
"""


def test_the_lighthouse_ends_with_a_sigkilled_launcher(marked: LeakCheck, tmp_path: Any) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "lh.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=marked.process_env(PYTHONPATH=SRC),
    )
    try:
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline())
        assert pid_alive(pid)
        launcher.kill()
        launcher.wait(10)
        wait_until(lambda: not pid_alive(pid), 10, "the lighthouse ended with its launcher")
    finally:
        launcher.kill()
        launcher.wait(10)
        assert launcher.stdin is not None and launcher.stdout is not None
        launcher.stdin.close()
        launcher.stdout.close()


def test_the_relay_keeps_the_workers_address_when_the_lighthouse_moves(
    marked: LeakCheck, tmp_path: Any
) -> None:
    """One lighthouse, then another on another port (as on another node), each announced in
    the job's store: torchft's client, given the relay's address once, reaches each."""
    store = MemoryStore()
    key = job_key("job", KEY_NAME)
    relay = LighthouseRelay()
    relay.start()
    relay.follow(store, key)
    first = Lighthouse(LighthouseSettings(), str(tmp_path / "first.log"))
    second = Lighthouse(LighthouseSettings(), str(tmp_path / "second.log"))
    client = torchft_client_module().LighthouseClient(relay.address, timedelta(seconds=10))

    def ask(group: str) -> list[str]:
        got = client.quorum(replica_id=group, timeout=timedelta(seconds=10), world_size=1)
        return [member.replica_id for member in got.participants]

    try:
        first.start()
        store.set(key, announcement("127.0.0.1", first.port or 0))
        wait_until(lambda: relay.target == ("127.0.0.1", first.port), 10, "the relay follows")
        assert ask("group0") == ["group0"]
        first.close()
        second.start()
        assert second.port != first.port
        store.set(key, announcement("127.0.0.1", second.port or 0))
        wait_until(lambda: relay.target == ("127.0.0.1", second.port), 10, "the relay follows")
        assert ask("group1") == ["group1"]  # the same client, connected again through the relay
        assert relay.relayed >= 2
    finally:
        first.close()
        second.close()
        relay.close()
        store.close()
