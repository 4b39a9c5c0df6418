"""Each node's kept state, also on other nodes: a survivor of a node's loss, or the node its
ranks moved to, resumes from it (``agent.state``).

Every agent serves its shared-memory state directory on a TCP port of its own. After each
committed save, in the background, it pushes the rank's newest slot to its successors in ring
order over the round's members (``--state-replicas``: the next one by default), which keep it
under ``peers/`` (two slots a rank, committed as a worker commits: the header last). Before an
attempt, a node whose new ranks' agreed step is not on it pulls it from a node that has it. A
connection proves it knows the job's token (posted through the store, which only members reach)
by HMAC over a fresh nonce, as the built-in store's clients do; every read and write has a
deadline; sizes are bounded by the state memory.

Wire (big-endian): the server sends a nonce; the client answers its proof, then one request:

- ``P`` rank u32, slot u8, size u64, then ``size`` bytes of a slot file and one byte: 1 when
  the slot was not rewritten while sent (the receiver commits it), 0 otherwise;
- ``G`` rank u32, step i64: the server answers size u64 and that many bytes of a committed
  slot of ``rank`` at ``step`` (its own, a peer copy, or a replicated save; size 0: none).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading

from relaunch.core import state as layout
from relaunch.runtime import start_thread
from relaunch.state.files import PEERS, file_header, find_slot, slot_header, write_all
from relaunch.store import auth

log = logging.getLogger(__name__)

#: Seconds any one read or write of a peer connection may take.
IO_TIMEOUT = 30.0
_PUSH = struct.Struct("!cIBQ")
_PULL = struct.Struct("!cIq")
_SIZE = struct.Struct("!Q")
_MAX_RANK = 1 << 24
_CHUNK = 1 << 20


class PeerLink:
    """This node's state server, and its pushes to its successors."""

    def __init__(self, directory: str, host: str, limit: int) -> None:
        self.directory, self.limit = directory, limit
        os.makedirs(os.path.join(directory, PEERS), exist_ok=True)
        self.token = secrets.token_hex(16)
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._closing = False
        self._successors: list[tuple[str, str]] = []  # (address, token) each
        self._dirty: set[int] = set()  # global ranks with a save not pushed yet
        self._wanted = threading.Condition()
        self._pushing: socket.socket | None = None  # the push under way
        self._holds = 0  # calls of ``hold`` so far
        self._accepter = start_thread(self._accept, "relaunch-state-peers")
        self._pusher = start_thread(self._push_loop, "relaunch-state-push")

    # -- the server -----------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return  # closed
            if self._closing:
                connection.close()
                return
            start_thread(self._serve, "relaunch-state-peer", connection)

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(IO_TIMEOUT)
            try:
                challenge = auth.nonce()
                connection.sendall(challenge)
                answer = _read_exactly(connection, 32)
                if not auth.verify(self.token, b"client", challenge, answer):
                    log.warning("a state peer connection without the job's token was refused")
                    return
                kind = _read_exactly(connection, 1)
                if kind == b"P":
                    self._receive(connection)
                elif kind == b"G":
                    self._send_pulled(connection)
            except (OSError, ValueError) as exc:
                log.debug("a state peer connection ended: %s", exc)

    def _receive(self, connection: socket.socket) -> None:
        rank, slot, size = _PUSH.unpack(b"P" + _read_exactly(connection, _PUSH.size - 1))[1:]
        if rank >= _MAX_RANK or slot not in layout.SLOTS:
            raise ValueError(f"a push of rank {rank} slot {slot} is not one relaunch sends")
        if not layout.HEADER_SIZE <= size <= self.limit:
            raise ValueError(f"a push of {size} bytes is more than the state memory holds")
        head = _read_exactly(connection, layout.HEADER_SIZE)
        path = os.path.join(self.directory, PEERS, layout.slot_name(rank, slot))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            write_all(fd, bytes(layout.HEADER_SIZE), 0)  # uncommitted while it is rewritten
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            _receive_into(connection, fd, layout.HEADER_SIZE, size)
            if _read_exactly(connection, 1) == b"\1" and layout.read_header(head) is not None:
                write_all(fd, head, 0)
        finally:
            os.close(fd)

    def _send_pulled(self, connection: socket.socket) -> None:
        _, rank, step = _PULL.unpack(b"G" + _read_exactly(connection, _PULL.size - 1))
        path = None if rank >= _MAX_RANK else find_slot(self.directory, rank, step)
        fd = -1 if path is None else os.open(path, os.O_RDONLY)
        try:
            head = None if fd < 0 else slot_header(fd)
            if head is None or head.step != step:
                connection.sendall(_SIZE.pack(0))
                return
            connection.sendall(_SIZE.pack(head.size))
            _send_file(connection, fd, head.size)
        finally:
            if fd >= 0:
                os.close(fd)

    # -- the client -----------------------------------------------------------------------

    def follow(self, successors: list[tuple[str, str]]) -> None:
        """Push to ``successors`` (their addresses and tokens) from now on."""
        with self._wanted:
            self._successors = list(successors)

    def saved(self, rank: int) -> None:
        """Global rank ``rank`` committed a save: push it (its newest, when the pusher gets to
        it: saves that come faster than the network are skipped, never queued)."""
        with self._wanted:
            if self._successors:
                self._dirty.add(rank)
                self._wanted.notify()

    def hold(self) -> None:
        """Push nothing more until the next save, and cut the push under way short (its
        receiver keeps its previous copy): the workers stop to restart, and a copy of a state
        already held would only take the machine's time from their start."""
        with self._wanted:
            self._holds += 1
            self._dirty.clear()
            if self._pushing is not None:
                try:
                    self._pushing.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _push_loop(self) -> None:
        while True:
            with self._wanted:
                while not self._dirty and not self._closing:
                    self._wanted.wait()
                if self._closing:
                    return
                rank = self._dirty.pop()
                successors, holds = self._successors, self._holds
            for successor in successors:  # one lost does not keep the copy from the others
                try:
                    self._push(rank, successor, holds)
                except (OSError, ValueError) as exc:
                    log.debug("could not copy rank %d's state to %s: %s", rank, successor[0], exc)

    def _push(self, rank: int, successor: tuple[str, str], holds: int) -> None:
        newest = None
        for slot in layout.SLOTS:
            path = os.path.join(self.directory, layout.slot_name(rank, slot))
            head = file_header(path)
            if head is not None and (newest is None or head.generation > newest[1].generation):
                newest = (slot, head, path)
        if newest is None:
            return
        slot, head, path = newest
        fd = os.open(path, os.O_RDONLY)
        try:
            with _connect(successor) as connection:
                with self._wanted:
                    if self._holds != holds:
                        return  # held since this push was chosen
                    self._pushing = connection
                connection.sendall(_PUSH.pack(b"P", rank, slot, head.size))
                _send_file(connection, fd, head.size)
                again = slot_header(fd)
                whole = again is not None and again.generation == head.generation
                connection.sendall(b"\1" if whole else b"\0")
                connection.shutdown(socket.SHUT_WR)
                connection.recv(1)  # the receiver's close: the copy is committed there
        finally:
            with self._wanted:
                self._pushing = None
            os.close(fd)

    def pull(self, holder: tuple[str, str], rank: int, step: int, target: str) -> bool:
        """Fetch ``rank``'s state of ``step`` from ``holder`` into the slot file ``target``;
        whether it came."""
        with _connect(holder) as connection:
            connection.sendall(_PULL.pack(b"G", rank, step))
            (size,) = _SIZE.unpack(_read_exactly(connection, _SIZE.size))
            if not layout.HEADER_SIZE <= size <= self.limit:
                return False
            temporary = f"{target}.pull"
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _receive_into(connection, fd, 0, size)
            except BaseException:
                os.close(fd)
                os.unlink(temporary)
                raise
            os.close(fd)
            os.replace(temporary, target)
            return True

    def close(self) -> None:
        with self._wanted:
            self._closing = True
            self._wanted.notify()
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        self._pusher.join()


def _connect(peer: tuple[str, str]) -> socket.socket:
    """A connection to ``peer`` (address, token) that has proved the token."""
    address, token = peer
    host, _, port = address.rpartition(":")
    connection = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT)
    try:
        challenge = _read_exactly(connection, auth.NONCE_BYTES)
        connection.sendall(auth.proof(token, b"client", challenge))
    except BaseException:
        connection.close()
        raise
    return connection


def _send_file(connection: socket.socket, fd: int, size: int) -> None:
    """``size`` bytes of file ``fd`` from its start, kernel to kernel (``sendfile``)."""
    with os.fdopen(os.dup(fd), "rb") as file:
        if connection.sendfile(file, 0, size) != size:
            raise ValueError("the slot ended before its header says")


def _receive_into(connection: socket.socket, fd: int, offset: int, end: int) -> None:
    """The bytes ``offset`` to ``end`` of a slot file, from ``connection`` into file ``fd``."""
    buffer = bytearray(min(_CHUNK, max(0, end - offset)))
    while offset < end:
        view = memoryview(buffer)[: min(len(buffer), end - offset)]
        _read_into(connection, view)
        write_all(fd, view, offset)
        offset += len(view)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    _read_into(connection, memoryview(data))
    return bytes(data)


def _read_into(connection: socket.socket, view: memoryview) -> None:
    while view:
        got = connection.recv_into(view)
        if got == 0:
            raise ValueError("the peer closed the connection")
        view = view[got:]
