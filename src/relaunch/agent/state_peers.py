"""Each node's kept state, also on other nodes: a survivor of a node's loss, or the node its
ranks moved to, resumes from it (``agent.state``).

Every agent serves its shared-memory state directory on a TCP port of its own. After each
committed save, in the background, it pushes the rank's newest save of a copy step (every
``--state-copy-every`` K-th step; every step by default) to its successors in ring order over
the round's members (``--state-replicas``: the next one by default), which keep it under
``peers/`` (the two newest copies a rank, committed as a worker commits: the header last).
Every node copies the same steps, and its workers keep their own two newest saves of them
(``core.state.slot_to_write``): a copy that takes up to K steps still meets, after a node's
loss, a step that every survivor kept. Before an attempt, a node whose new ranks' agreed step
is not on it pulls it from a node that has it. A connection proves it knows the job's token
(posted through the store, which only members reach) by HMAC over a fresh nonce, as the
built-in store's clients do; every read and write has a deadline; sizes are bounded by the
state memory.

Wire (big-endian): the server sends a nonce; the client answers its proof, then one request:

- ``P`` rank u32, slot u8 (the sender's; the receiver writes the older of its two copies),
  size u64, then ``size`` bytes of a slot file and one byte: 1 when the slot was not
  rewritten while sent (the receiver commits it), 0 otherwise;
- ``G`` rank u32, step i64: the server answers size u64 and that many bytes of a committed
  slot of ``rank`` at ``step`` (its own, a peer copy, or a replicated save; size 0: none).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator

from relaunch.core import state as layout
from relaunch.runtime import start_thread
from relaunch.state.files import PEERS, committed, find_slot, slot_header, write_all
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

    def __init__(self, directory: str, host: str, limit: int, copy_every: int = 1) -> None:
        self.directory, self.limit, self.copy_every = directory, limit, copy_every
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
        #: (global rank, successor address) -> the generation of the last save copied there.
        self._copied: dict[tuple[int, str], int] = {}
        self._slow_said = False  # a copy slower than the steps it may take was said
        self._receiving: set[int] = set()  # global ranks whose copy is being received
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
        with self._receiving_copy(rank):
            peers = os.path.join(self.directory, PEERS)
            copies = {n: h for n, h in committed(peers, rank).items() if n in layout.SLOTS[:2]}
            path = os.path.join(peers, layout.slot_name(rank, layout.slot_to_write(copies, 1)))
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                write_all(fd, bytes(layout.HEADER_SIZE), 0)  # uncommitted while rewritten
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                _receive_into(connection, fd, layout.HEADER_SIZE, size)
                if _read_exactly(connection, 1) == b"\1" and layout.read_header(head) is not None:
                    write_all(fd, head, 0)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _receiving_copy(self, rank: int) -> Iterator[None]:
        """One copy of ``rank`` received at a time (two would write the same slot)."""
        with self._wanted:
            if rank in self._receiving:
                raise ValueError(f"a copy of rank {rank} is being received already")
            self._receiving.add(rank)
        try:
            yield
        finally:
            with self._wanted:
                self._receiving.discard(rank)

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
        """Push to ``successors`` (their addresses and tokens) from now on, each save whether
        it was copied before or not (a re-formed world forgot the copies of later steps, and a
        step of its own may have a generation the forgotten one had)."""
        with self._wanted:
            self._successors = list(successors)
            self._copied.clear()

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
        saves = committed(self.directory, rank)
        copies = [
            (head.generation, slot)
            for slot, head in saves.items()
            if layout.is_copy_step(head.step, self.copy_every)
        ]
        if not copies:
            return
        slot = max(copies)[1]
        head = saves[slot]
        with self._wanted:
            if self._copied.get((rank, successor[0])) == head.generation:
                return  # copied there already (saves between copy steps call here too)
        path = os.path.join(self.directory, layout.slot_name(rank, slot))
        began = time.monotonic()
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
            if whole:
                with self._wanted:
                    self._copied[(rank, successor[0])] = head.generation
            if not head.replicated:
                self._say_if_slow(rank, successor[0], head, time.monotonic() - began, whole)
        finally:
            with self._wanted:
                self._pushing = None
            os.close(fd)

    def _say_if_slow(
        self, rank: int, successor: str, copied: layout.Header, seconds: float, whole: bool
    ) -> None:
        """Say once when a copy of state a rank saves on its own (not replicated) took as long
        as ``--state-copy-every`` steps (or was saved over while it was sent): a node's loss
        may then find no step that every rank kept."""
        if self._slow_said:
            return
        kept = committed(self.directory, rank).values()
        saves = max((head.generation for head in kept), default=copied.generation)
        saves -= copied.generation  # the rank's saves since the one copied
        if whole and saves < self.copy_every:
            return
        self._slow_said = True
        late = f"{saves} save{'' if saves == 1 else 's'} behind when it arrived"
        log.warning(
            "the copy of rank %d's state (%s) to %s was %s (%.2fs): should this node be lost, "
            "no step may be kept for every rank; raise --state-copy-every (now %d) to at "
            "least %d",
            rank,
            layout.format_bytes(copied.size),
            successor,
            late if whole else "saved over while it was sent",
            seconds,
            self.copy_every,
            max(2 * saves, self.copy_every + 1),
        )

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
