"""Kept state's copies between nodes, from outside the job (issue 43, items 1 and 2).

What a node's state server takes is unpickled by a worker. It used to prove a token it posted
in the store: with no store token (the default) an outsider who reached the store read it,
planted a pickle that both workers ran after one ordinary failure, and downloaded a rank's
state. Now nothing is copied without the job's token, and with one, both ends prove a key
derived from it that travels nowhere, and every slot carries an HMAC checked before it is kept.

Its server ran a thread per connection, uncapped, before authentication, read with 30 s a read
and died on the first ``EMFILE``. Now it serves a bounded number (fewer before a proof), gives
a handshake 3 s in all, rests and goes on when out of descriptors or threads, and sums up the
connections it refuses.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import LeakCheck, LinesRead, wait_until

from relaunch.agent import peer_server
from relaunch.agent.state_peers import PeerLink
from relaunch.core.workers import state as layout
from relaunch.endpoints import find_free_port
from relaunch.state.files import PEERS, SlotWriter, committed
from relaunch.store import auth
from relaunch.store.client import TcpStore

pytestmark = pytest.mark.timeout(90)

KEY = "the job's key"
SRC = str(pathlib.Path(__file__).parents[2] / "src")


def commit(directory: pathlib.Path | str, rank: int, step: int, data: bytes) -> pathlib.Path:
    """Commit ``data`` (one pickled part) as ``rank``'s ``step`` in slot 0 of ``directory``."""
    path = pathlib.Path(directory, layout.slot_name(rank, 0))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    writer = SlotWriter(fd)
    try:
        writer.write(step, step + 1, [memoryview(data)])
    finally:
        writer.close()
        os.close(fd)
    return path


def copies(directory: pathlib.Path | str, rank: int) -> list[int]:
    """The steps of ``rank`` committed under ``directory``'s ``peers/``."""
    return sorted(head.step for head in committed(os.path.join(directory, PEERS), rank).values())


@pytest.fixture
def link(tmp_path: pathlib.Path) -> Iterator[PeerLink]:
    """A node's state server (and pusher), keyed with ``KEY``."""
    directory = tmp_path / "server"
    directory.mkdir()
    served = PeerLink(str(directory), "127.0.0.1", 1 << 30, KEY)
    yield served
    served.close()


def member(tmp_path: pathlib.Path, name: str, key: str = KEY) -> PeerLink:
    directory = tmp_path / name
    directory.mkdir()
    return PeerLink(str(directory), "127.0.0.1", 1 << 30, key)


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def recv_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


# -- the attack of issue 43: from the store to a worker's unpickling -------------------------

JOB = textwrap.dedent(
    """
    import os, pathlib, sys, time
    import relaunch
    out = pathlib.Path(sys.argv[1])
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    loaded = relaunch.load_state()
    if attempt != "0":
        (out / f"resumed.{rank}").write_text(repr(None if loaded is None else loaded[0]))
        sys.exit(0)
    for step in range(5):
        relaunch.save_state({"rank": rank, "step": step}, step)
    (out / f"saved.{rank}").write_text("")
    deadline = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the test's attack first
    if rank == "1":
        sys.exit(1)  # an ordinary failure: the job restarts and loads its state
    time.sleep(60)  # stopped by the restart
    """
)


class Planted:
    """What runs when a worker unpickles the outsider's state: it writes the worker's uid."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        code = f"open({str(self.marker)!r}, 'w').write(str(__import__('os').getuid()))"
        return exec, (code,)


def state_records(port: int, run_id: str, token: str | None) -> list[dict[str, object]]:
    """Every node's state record of the job's rounds, as whoever reads the store sees them."""
    records = []
    with TcpStore("127.0.0.1", port, token, timeout=5, connect_timeout=5) as store:
        for round_ in range(8):
            for group_rank in range(2):
                key = f"relaunch/{run_id}/r{round_}/notes/state/{group_rank}"
                value = store.get(key).value
                if value is not None:
                    records.append(json.loads(value))
    return records


def plant(address: str, secret: str, rank: int, slot: bytes) -> None:
    """Push ``slot`` as ``rank``'s copy, proving ``secret`` as the server's nonce asks."""
    with connect(address) as connection:
        challenge = recv_exactly(connection, auth.NONCE_BYTES)
        connection.sendall(auth.proof(secret, b"client", challenge))
        connection.sendall(struct.pack("!cIBQ", b"P", rank, 0, len(slot)) + slot + b"\1")
        connection.shutdown(socket.SHUT_WR)
        while connection.recv(1 << 16):
            pass


def steal(address: str, secret: str, rank: int, step: int) -> bytes:
    """Ask for ``rank``'s state of ``step``, proving ``secret``; what came (b"": nothing)."""
    with connect(address) as connection:
        challenge = recv_exactly(connection, auth.NONCE_BYTES)
        connection.sendall(auth.proof(secret, b"client", challenge))
        connection.sendall(struct.pack("!cIq", b"G", rank, step))
        data = b""
        while chunk := connection.recv(1 << 16):
            data += chunk
        return data[8:] if len(data) > 8 else b""


@pytest.mark.parametrize("token", [None, "the-job-token"], ids=["no token", "token"])
def test_an_outsider_who_reads_the_store_can_neither_plant_nor_take_a_ranks_state(
    tmp_path: pathlib.Path, leaks: LeakCheck, token: str | None
) -> None:
    """The issue's attack on a job of two nodes: the outsider reads every state record in the
    store (with a token, as a leak of the store's content would show it), pushes a newer step
    holding a pickle to every node for ranks 0 and 1 and asks for rank 1's state; then rank 1
    fails once. Nothing it pushed is loaded, nothing it asked for comes, and both ranks resume
    from their own step 4. Without a token, each node says once that its state stays there."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port, run_id = find_free_port(), f"peers-{os.getpid()}-{token is not None}"
    env = {**leaks.process_env(), "RELAUNCH_RDZV_TOKEN": token or ""}
    command = [
        sys.executable,
        "-m",
        "relaunch",
        *("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id),
        *(str(script), str(out)),
    ]
    agents = [
        subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(2)
    ]
    try:
        wait_until(lambda: all((out / f"saved.{rank}").exists() for rank in range(2)), 40)
        records = state_records(port, run_id, token)
        assert len(records) == 2, records
        marker = tmp_path / "planted"
        with tempfile.TemporaryDirectory() as forging:
            forged = commit(forging, 0, 10**6, pickle.dumps(Planted(marker))).read_bytes()
        stolen = []
        for record in records:
            assert set(record) <= {"address", "held", "replicated", "runs", "token"}
            address = record.get("address")
            if not isinstance(address, str):
                continue  # no server to reach
            secret = str(record.get("token", ""))  # all it could find
            for rank in range(2):
                try:
                    plant(address, secret, rank, forged)
                except OSError:
                    pass  # refused
            try:
                stolen.append(steal(address, secret, 1, 4))
            except OSError:
                pass
        (out / "go").write_text("")
        errors = [agent.communicate(timeout=60)[1] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], "\n---\n".join(errors)
    assert not marker.exists(), f"the outsider's pickle ran (uid {marker.read_text()})"
    assert not any(stolen), "the outsider took rank 1's state"
    assert [(out / f"resumed.{rank}").read_text() for rank in range(2)] == ["4", "4"]
    said = [error.count("kept state stays on this node") for error in errors]
    assert said == ([1, 1] if token is None else [0, 0]), errors


# -- with the job's key: members only ---------------------------------------------------------


def impostor(slot: bytes) -> tuple[str, threading.Thread]:
    """A server that does not know the key: it takes any proof, answers one it made up, and
    sends ``slot`` as whatever is asked for; its address and thread."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener, listener.accept()[0] as connection:
            connection.settimeout(10)
            connection.sendall(auth.nonce())
            recv_exactly(connection, 2 * auth.NONCE_BYTES)
            connection.sendall(os.urandom(auth.NONCE_BYTES))
            try:
                recv_exactly(connection, 13)  # a pull's request, if it comes
                connection.sendall(struct.pack("!Q", len(slot)) + slot + bytes(32))
            except (ConnectionError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_without_the_key_nothing_is_pushed_nor_pulled_either_way(
    tmp_path: pathlib.Path, link: PeerLink
) -> None:
    """A client with another key pulls nothing and pushes nothing that is kept; a member
    pulls nothing from a server that cannot prove the key (it would load what that one sent)."""
    commit(link.directory, 2, 5, b"rank 2's state")
    outsider = member(tmp_path, "outsider", key="a guess")
    honest = member(tmp_path, "honest")
    try:
        target = tmp_path / "pulled"
        with pytest.raises((OSError, ValueError)):
            outsider.pull(link.address, 2, 5, str(target))
        assert not target.exists()
        commit(outsider.directory, 3, 9, b"planted")
        outsider.follow([link.address])
        outsider.saved(3)
        wait_until(lambda: link.server.refused >= 2, 10, "the push to be refused")
        assert copies(link.directory, 3) == []
        forged = commit(tmp_path / "outsider", 2, 5, b"what the impostor says").read_bytes()
        address, thread = impostor(forged)
        with pytest.raises(ValueError, match="does not know the job's key"):
            honest.pull(address, 2, 5, str(target))
        thread.join(10)
        assert not target.exists()
        assert honest.pull(link.address, 2, 5, str(target))  # the real one, for contrast
    finally:
        outsider.close()
        honest.close()


class Tamperer:
    """A TCP relay to ``address`` that flips one byte of what the client sends
    (``upstream``) or of what the server answers (else), at ``offset``."""

    def __init__(self, address: str, offset: int, upstream: bool) -> None:
        self._target, self._offset, self._upstream = address, offset, upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        server = connect(self._target)
        for source, sink, flip in (
            (client, server, self._upstream),
            (server, client, not self._upstream),
        ):
            thread = threading.Thread(target=self._relay, args=(source, sink, flip), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _relay(self, source: socket.socket, sink: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while chunk := source.recv(1 << 16):
                if flip and seen <= self._offset < seen + len(chunk):
                    at = self._offset - seen
                    chunk = chunk[:at] + bytes([chunk[at] ^ 0x01]) + chunk[at + 1 :]
                seen += len(chunk)
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        for thread in self._threads[1:]:
            thread.join(10)


def test_a_slot_changed_on_the_way_is_not_kept_either_way(
    tmp_path: pathlib.Path, link: PeerLink
) -> None:
    """Between two members, one byte of a slot flipped on the wire (after both proved the key):
    the pushed copy is not committed, and the pulled one is not put in place."""
    pusher = member(tmp_path, "pusher")
    handshake = 2 * auth.NONCE_BYTES + 14  # the client's proof and nonce, and its push request
    relay = Tamperer(link.address, handshake + layout.HEADER_SIZE + 100, upstream=True)
    try:
        commit(pusher.directory, 4, 7, bytes(1 << 16))
        pusher.follow([relay.address])
        pusher.saved(4)
        wait_until(lambda: link.server.refused >= 1, 10, "the changed copy to be refused")
        assert copies(link.directory, 4) == []
    finally:
        pusher.close()
        relay.close()
    commit(link.directory, 4, 8, bytes(1 << 16))
    puller = member(tmp_path, "puller")
    answer = 2 * auth.NONCE_BYTES + 8  # the server's nonce and proof, and the size
    relay = Tamperer(link.address, answer + layout.HEADER_SIZE + 100, upstream=False)
    target = tmp_path / "pulled"
    try:
        with pytest.raises(ValueError, match="failed its check"):
            puller.pull(relay.address, 4, 8, str(target))
        assert not target.exists() and not pathlib.Path(f"{target}.pull").exists()
    finally:
        puller.close()
        relay.close()


# -- the server, bounded for whoever reaches it -----------------------------------------------


def test_idle_connections_hold_no_more_threads_than_the_cap_and_a_member_still_gets_in(
    tmp_path: pathlib.Path, link: PeerLink
) -> None:
    """300 connections that never prove anything: at most ``MAX_UNPROVEN`` are served (a
    thread each) at once; a member's push lands within seconds all the same (it takes the
    place of an idle one that had its grace)."""
    before = threading.active_count()
    idle = []
    try:
        for _ in range(300):
            idle.append(connect(link.address))
        wait_until(lambda: link.server.serving()[1] == peer_server.MAX_UNPROVEN, 10)
        peak = threading.active_count() - before
        assert peak <= peer_server.MAX_UNPROVEN + 1, peak
        pusher = member(tmp_path, "pusher")
        try:
            commit(pusher.directory, 1, 3, b"a member's state")
            began = time.monotonic()
            pusher.follow([link.address])
            pusher.saved(1)
            wait_until(lambda: copies(link.directory, 1) == [3], 30, "the member's copy")
            # Ahead of it in the kernel's queue: up to 300 idle ones, made room for
            # MAX_UNPROVEN at a time after HANDSHAKE_GRACE.
            assert time.monotonic() - began < 300 / peer_server.MAX_UNPROVEN + 5
        finally:
            pusher.close()
        assert threading.active_count() - before <= peer_server.MAX_UNPROVEN + 2
    finally:
        for connection in idle:
            connection.close()


def stalled_push(address: str, rank: int) -> socket.socket:
    """A member's connection that proves the key, asks to push ``rank``'s slot, and then sends
    nothing: its server thread waits for the slot (``IO_TIMEOUT`` a read)."""
    connection = connect(address)
    challenge = recv_exactly(connection, auth.NONCE_BYTES)
    connection.sendall(auth.proof(KEY, b"client", challenge) + auth.nonce())
    recv_exactly(connection, auth.NONCE_BYTES)  # the server's proof
    connection.sendall(struct.pack("!cIBQ", b"P", rank, 0, layout.HEADER_SIZE + 16))
    return connection


def test_proven_connections_are_capped_and_a_newcomer_waits_its_turn(
    link: PeerLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Members' connections that proved the key hold a thread each: at most
    ``MAX_CONNECTIONS`` are served at once; a newcomer waits in the kernel's queue (not even
    greeted) until one of them ends, then is served."""
    monkeypatch.setattr(peer_server, "MAX_CONNECTIONS", 4)
    held = [stalled_push(link.address, rank) for rank in range(4)]
    newcomer = None
    try:
        wait_until(lambda: link.server.serving() == (4, 0), 10, "four proven connections")
        newcomer = connect(link.address)
        newcomer.settimeout(0.5)
        with pytest.raises(TimeoutError):
            newcomer.recv(1)  # no nonce: it was not accepted
        assert link.server.serving() == (4, 0)
        held.pop().close()
        newcomer.settimeout(10)
        assert len(recv_exactly(newcomer, auth.NONCE_BYTES)) == auth.NONCE_BYTES
        wait_until(lambda: link.server.serving() == (4, 1), 10, "the newcomer served")
    finally:
        for connection in [*held, *([newcomer] if newcomer else [])]:
            connection.close()


def test_a_connection_closed_to_make_room_holds_its_place_until_its_thread_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the unproven are at their cap, the one closed to make room for a newcomer counts
    until its thread has ended: the newcomer is accepted only then, so that the threads never
    outnumber ``MAX_UNPROVEN`` (under load, the ones cut lingered beside their successors: 48
    threads for a cap of 32)."""
    monkeypatch.setattr(peer_server, "MAX_UNPROVEN", 2)
    monkeypatch.setattr(peer_server, "HANDSHAKE_GRACE", 0.0)
    cut, release = threading.Event(), threading.Event()

    def handshake(connection: socket.socket, deadline: float) -> None:
        connection.sendall(b"x")  # greeted: accepted
        if connection.recv(1) == b"":  # closed to make room: the thread lingers
            cut.set()
            release.wait(30)
        raise ConnectionError("no proof")

    server: peer_server.PeerServer[None] = peer_server.PeerServer(
        "127.0.0.1", handshake, lambda connection, peer, request: None
    )
    clients = []
    try:
        for _ in range(2):
            clients.append(connect(server.address))
            assert recv_exactly(clients[-1], 1) == b"x"
        clients.append(connect(server.address))  # the newcomer
        assert cut.wait(10), "the oldest was never closed to make room"
        turned = threading.Event()
        server._loop.call_soon(turned.set)  # after the turn that made room
        assert turned.wait(10)
        assert server.serving() == (2, 1)  # the one cut and the other; not the newcomer
        release.set()
        assert recv_exactly(clients[-1], 1) == b"x"
        wait_until(lambda: server.serving() == (2, 2), 10, "the newcomer served")
    finally:
        release.set()
        for connection in clients:
            connection.close()
        server.close()


def test_a_slow_handshake_is_cut_at_its_deadline(link: PeerLink) -> None:
    """A client that sends 3 bytes of its 64, then one byte every half second, is cut
    ``HANDSHAKE_TIMEOUT`` seconds after it connected, not after 30 s a read."""
    with connect(link.address) as connection:
        began = time.monotonic()
        recv_exactly(connection, auth.NONCE_BYTES)
        connection.sendall(b"abc")
        connection.settimeout(0.5)
        ended = None
        while time.monotonic() - began < 15:
            try:
                if connection.recv(1) == b"":
                    ended = time.monotonic() - began
                    break
            except TimeoutError:
                pass
            except ConnectionError:
                ended = time.monotonic() - began
                break
            try:
                connection.sendall(b"x")
            except OSError:
                ended = time.monotonic() - began
                break
    assert ended is not None, "still connected after 15 s"
    assert peer_server.HANDSHAKE_TIMEOUT - 0.1 <= ended <= peer_server.HANDSHAKE_TIMEOUT + 2


def test_garbage_connections_are_summed_up_in_a_few_lines(
    tmp_path: pathlib.Path, link: PeerLink, caplog: pytest.LogCaptureFixture
) -> None:
    """300 connections that send garbage: one line for the first, one that sums up the others
    (at the interval's end, or when the server closes), and the server serves on."""
    caplog.set_level(logging.WARNING)
    for _ in range(300):
        with connect(link.address) as connection:
            recv_exactly(connection, auth.NONCE_BYTES)
            connection.sendall(os.urandom(64))
            connection.shutdown(socket.SHUT_WR)
            while connection.recv(1 << 10):
                pass
    wait_until(lambda: link.server.refused == 300, 10)
    commit(link.directory, 0, 1, b"served on")
    honest = member(tmp_path, "honest")
    try:
        assert honest.pull(link.address, 0, 1, str(tmp_path / "pulled"))
    finally:
        honest.close()
    link.close()  # the summary of the interval under way
    said = [
        record.getMessage() for record in caplog.records if "state peers" in record.getMessage()
    ]
    assert len(said) == 2, said
    assert "299 more connections" in said[1] and "without the job's key" in said[1], said


# -- out of descriptors, out of threads: a child process with its limits lowered ---------------

CHILD = textwrap.dedent(
    """
    import logging, os, resource, sys, threading
    sys.path.insert(0, {src!r})
    threading.stack_size(8 << 20)
    from relaunch.agent.state_peers import PeerLink
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    link = PeerLink(sys.argv[1], "127.0.0.1", 1 << 20, {key!r})
    if sys.argv[2] == "files":  # 4 more descriptors
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
    else:  # room for the stacks of 3 more threads
        size = [line for line in open("/proc/self/status") if line.startswith("VmSize")]
        room = int(size[0].split()[1]) * 1024 + 3 * (8 << 20)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (room + (4 << 20), hard))
    print(link.address, flush=True)
    sys.stdin.read()  # until the test closes it
    link.close()
    """
)


class Child:
    """A state server in a process of its own, its lines read as they come."""

    def __init__(self, leaks: LeakCheck, directory: pathlib.Path, short_of: str) -> None:
        directory.mkdir()
        self.directory = directory
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(src=SRC, key=KEY), str(directory), short_of],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=leaks.process_env(),
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        self.address = self.process.stdout.readline().strip()
        self.stderr = LinesRead(self.process.stderr)

    def close(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            code = self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.stderr.join()
        return code


@pytest.mark.parametrize(
    ("shortage", "connections", "said"),
    [("files", 40, "cannot accept more connections"), ("threads", 20, "no thread to serve it")],
)
def test_out_of_descriptors_or_threads_the_server_goes_on(
    tmp_path: pathlib.Path, leaks: LeakCheck, shortage: str, connections: int, said: str
) -> None:
    """The server's process may open 4 more files (40 connections find it out of
    descriptors: it rests and says so once), or has room for 3 more threads' stacks (of 20
    connections, those that find no thread are closed, summed up). Its accept loop never
    dies: once the connections are gone, a member's push lands."""
    child = Child(leaks, tmp_path / "child", shortage)
    pusher = member(tmp_path, "pusher")
    idle = []
    try:
        for _ in range(connections):
            idle.append(connect(child.address))
        wait_until(lambda: child.stderr.count(said) >= 1, 10, f"the server to say {said!r}")
        for connection in idle:
            connection.close()
        commit(pusher.directory, 6, 2, b"after the shortage")
        pusher.follow([child.address])
        pusher.saved(6)
        wait_until(lambda: copies(child.directory, 6) == [2], 20, "the member's copy")
    finally:
        for connection in idle:
            connection.close()
        pusher.close()
        assert child.close() == 0, child.stderr.text()
    assert child.stderr.count("thread failed") == 0, child.stderr.lines
    if shortage == "files":
        assert child.stderr.count(said) == 1, child.stderr.lines
