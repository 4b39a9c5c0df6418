"""A node's pushes of its kept state to its successors (``agent.state_peers``): held while the
workers restart, going on at the next save, and to every successor though one is gone."""

from __future__ import annotations

import contextlib
import os
import pathlib
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until

from relaunch.agent.state_peers import PeerLink
from relaunch.core.workers import state as layout
from relaunch.state.files import PEERS, SlotWriter, committed
from relaunch.store import auth

PUSH = struct.Struct("!IBQ")  # after the request's kind: rank, slot, size


def commit(directory: pathlib.Path, rank: int, slot: int, step: int, size: int) -> int:
    """Commit ``size`` bytes as ``rank``'s ``step`` in ``slot`` of ``directory``; the slot's
    size in bytes."""
    fd = os.open(directory / layout.slot_name(rank, slot), os.O_RDWR | os.O_CREAT, 0o600)
    writer = SlotWriter(fd)
    try:
        return writer.write(step, step + 1, [memoryview(bytes([step]) * size)])
    finally:
        writer.close()
        os.close(fd)


KEY = "the job's key"


class Successor:
    """A successor that takes pushes as the real one does, and can stop reading one. ``close``
    ends its thread (and raises what ended it early, if anything)."""

    def __init__(self, key: str = KEY) -> None:
        self.key = key
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.pushes: queue.Queue[tuple[int, int, int, int]] = queue.Queue()
        self.stall = threading.Event()  # the next push stops being read after its header
        self.stalled = threading.Event()
        self._closing = False
        self._connection: socket.socket | None = None  # the one being read
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="successor", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                try:
                    connection, _ = self.server.accept()
                except OSError:
                    return
                self._connection = connection
                with connection:
                    self._take(connection)
        except BaseException as exc:
            if not self._closing:
                self._error = exc

    def _take(self, connection: socket.socket) -> None:
        connection.settimeout(30)
        challenge = auth.nonce()
        connection.sendall(challenge)
        answer = self._read(connection, 64)
        assert auth.verify(self.key, b"client", challenge, answer[:32])
        connection.sendall(auth.proof(self.key, b"server", answer[32:]))
        assert self._read(connection, 1) == b"P"
        rank, slot, size = PUSH.unpack(self._read(connection, PUSH.size))
        if self.stall.is_set():
            self.stall.clear()
            self.stalled.set()
            got = len(connection.recv(1 << 16))
            while chunk := connection.recv(1 << 16):  # once the sender gives up
                got += len(chunk)
            self.pushes.put((rank, slot, size, got))
            return
        head = self._read(connection, size)
        whole = self._read(connection, 1) == b"\1"
        self._read(connection, 32)  # its HMAC (checked by the real one)
        found = layout.read_header(head[: layout.HEADER_SIZE]) if whole else None
        self.pushes.put((rank, slot, size, -1 if found is None else found.step))

    @staticmethod
    def _read(connection: socket.socket, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = connection.recv(min(size - len(data), 1 << 20))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        """Stop listening, end the connection being read, and wait for the thread: closing a
        listening socket alone leaves a thread in ``accept`` for good."""
        self._closing = True
        for sock in (self.server, self._connection):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the successor's thread did not end"
        if self._error is not None:
            raise self._error


@pytest.fixture
def successors() -> Iterator[Callable[[], Successor]]:
    """Makes successors; every one is closed (its thread ended) at the test's end."""
    made: list[Successor] = []

    def make() -> Successor:
        made.append(Successor())
        return made[-1]

    yield make
    for successor in made:
        successor.close()


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """Every thread a test starts (successors', ``PeerLink``'s) has ended by its end."""
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


@pytest.mark.timeout(60)
def test_a_held_push_is_cut_short_and_the_next_save_is_pushed(
    tmp_path: pathlib.Path, successors: Callable[[], Successor]
) -> None:
    """``hold`` (the workers stop) ends the push under way, though its receiver reads nothing
    more; the next save is pushed whole."""
    link = PeerLink(str(tmp_path), "127.0.0.1", 1 << 30, KEY)
    successor = successors()
    try:
        link.follow([successor.address])
        size = commit(tmp_path, 3, 0, 7, 64 << 20)  # more than the socket buffers hold
        successor.stall.set()
        link.saved(3)
        wait_until(successor.stalled.is_set, 30, "the push to start")
        link.hold()
        rank, slot, sent, got = successor.pushes.get(timeout=30)  # the sender gave up
        assert (rank, slot, sent) == (3, 0, size) and got < size
        small = commit(tmp_path, 3, 1, 8, 1 << 10)
        link.saved(3)
        assert successor.pushes.get(timeout=30) == (3, 1, small, 8)
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_a_save_is_pushed_to_every_successor_though_one_of_them_is_gone(
    tmp_path: pathlib.Path, successors: Callable[[], Successor]
) -> None:
    """``--state-replicas 3``: each save goes to the three next nodes; one of them no longer
    listening (lost with the node being lost too) keeps the copy from none of the others."""
    link = PeerLink(str(tmp_path), "127.0.0.1", 1 << 30, KEY)
    first, third = successors(), successors()
    gone = socket.create_server(("127.0.0.1", 0))
    gone_address = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()  # its port refuses connections, as a lost node's does
    try:
        link.follow([first.address, gone_address, third.address])
        size = commit(tmp_path, 5, 0, 11, 1 << 20)
        link.saved(5)
        assert first.pushes.get(timeout=30) == (5, 0, size, 11)
        assert third.pushes.get(timeout=30) == (5, 0, size, 11)
        link.follow([])  # nobody to push to: a save is not pushed
        commit(tmp_path, 5, 1, 12, 1 << 10)
        link.saved(5)
        link.follow([first.address])
        small = commit(tmp_path, 5, 0, 13, 1 << 10)
        link.saved(5)
        assert first.pushes.get(timeout=30) == (5, 0, small, 13)  # not 12: it was never sent
        assert third.pushes.empty()
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_only_copy_steps_are_pushed_once_each_and_the_receiver_keeps_its_two_newest(
    tmp_path: pathlib.Path, successors: Callable[[], Successor]
) -> None:
    """``--state-copy-every 4``: of saves 7 to 16, the pusher copies 8, 12 and 16, each once
    (a save between copy steps pushes nothing: the next push after 8 is 12), and the
    receiving node keeps the two newest, in its own two slots whatever the sender's."""
    sender_dir, receiver_dir = tmp_path / "a", tmp_path / "b"
    sender_dir.mkdir()
    receiver_dir.mkdir()
    sender = PeerLink(str(sender_dir), "127.0.0.1", 1 << 30, KEY, copy_every=4)
    receiver = PeerLink(str(receiver_dir), "127.0.0.1", 1 << 30, KEY)
    counted = successors()  # a second successor: what is sent, push by push
    peers = str(receiver_dir / PEERS)

    def copies() -> list[int]:
        return sorted(head.step for head in committed(peers, 2).values())

    try:
        sender.follow([receiver.address, counted.address])
        slots: dict[int, layout.Header] = {}
        for step in range(7, 17):
            slot = layout.slot_to_write(slots, 4)
            commit(sender_dir, 2, slot, step, 1 << 10)
            slots[slot] = layout.Header(step, step + 1, 1, 0, 0)
            sender.saved(2)
            if step in (8, 12, 16):
                wait_until(lambda step=step: step in copies(), 30, f"the copy of step {step}")
                assert counted.pushes.get(timeout=30)[3] == step
        assert copies() == [12, 16]
        assert set(committed(peers, 2)) == {0, 1}
        assert counted.pushes.empty()
    finally:
        sender.close()
        receiver.close()
