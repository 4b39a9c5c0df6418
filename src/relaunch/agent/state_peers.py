"""Each node's kept state, also on other nodes: a survivor of a node's loss, or the node its
ranks moved to, resumes from it (``agent.state``).

Every agent serves its shared-memory state directory on a TCP port of its own
(``agent.peer_server``: bounded for whoever reaches it). After each committed save, in the
background, it pushes the rank's newest save of a copy step (every ``--state-copy-every`` K-th
step; every step by default) to its successors in ring order over the round's members
(``--state-replicas``: the next one by default), which keep it under ``peers/`` (the two newest
copies a rank, committed as a worker commits: the header last). Every node copies the same
steps, and its workers keep their own two newest saves of them
(``core.workers.state.slot_to_write``): a copy that takes up to K steps still meets, after a node's
loss, a step that every survivor kept. Before an attempt, a node whose new ranks' agreed step is not
on it pulls it from a node that has it.

What arrives is unpickled by a worker, so nothing from the network is kept unless it is proved:
both ends prove the job's key (``JobServices.peer_key``: derived from the job's token, never
sent, posted nowhere) by HMAC over each other's fresh nonce, and every slot sent carries an
HMAC, keyed from the key and both nonces, over the request and every byte of it, checked before
the slot is committed (a push) or put in place (a pull). Without a token there is no key, and
no copies (``agent.state``). Every read and write has a deadline; sizes are bounded by the
state memory.

Wire (big-endian): the server sends its nonce; the client its proof and its nonce; the server
its proof; then the client one request:

- ``P`` rank u32, slot u8 (the sender's; the receiver writes the older of its two copies),
  size u64, then ``size`` bytes of a slot file, one byte: 1 when the slot was not rewritten
  while sent (the receiver commits it), 0 otherwise, and the HMAC;
- ``G`` rank u32, step i64: the server answers size u64, that many bytes of a committed slot
  of ``rank`` at ``step`` (its own, a peer copy, or a replicated save; size 0: none), and the
  HMAC.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from relaunch.agent.peer_server import IO_TIMEOUT, PeerServer, Refused
from relaunch.core.workers import state as layout
from relaunch.runtime import start_thread
from relaunch.state.files import PEERS, committed, find_slot, slot_header, write_all
from relaunch.store import auth

log = logging.getLogger(__name__)

_PUSH = struct.Struct("!cIBQ")
_PULL = struct.Struct("!cIq")
_SIZE = struct.Struct("!Q")
_MAC_BYTES = hashlib.sha256().digest_size
_MAX_RANK = 1 << 24
_CHUNK = 1 << 20


class _Request(NamedTuple):
    """A proved connection's request: its session key (``_session``), and the request's
    bytes (the kind first)."""

    session: bytes
    raw: bytes


class PeerLink:
    """This node's state server, and its pushes to its successors; ``key``: the job's
    (``JobServices.peer_key``), which every connection proves."""

    def __init__(
        self, directory: str, host: str, limit: int, key: str, copy_every: int = 1
    ) -> None:
        self.directory, self.limit, self.copy_every = directory, limit, copy_every
        self._key = key
        os.makedirs(os.path.join(directory, PEERS), exist_ok=True)
        self._closing = False
        self._successors: list[str] = []  # their addresses
        self._dirty: set[int] = set()  # global ranks with a save not pushed yet
        self._wanted = threading.Condition()
        self._pushing: socket.socket | None = None  # the push under way
        self._holds = 0  # calls of ``hold`` so far
        #: (global rank, successor address) -> the generation of the last save copied there.
        self._copied: dict[tuple[int, str], int] = {}
        self._slow_said = False  # a copy slower than the steps it may take was said
        self._receiving: set[int] = set()  # global ranks whose copy is being received
        self.server = PeerServer(host, self._handshake, self._serve)
        self.address = self.server.address
        self._pusher = start_thread(self._push_loop, "relaunch-state-push")

    # -- the server -----------------------------------------------------------------------

    def _handshake(self, connection: socket.socket, deadline: float) -> _Request:
        """Prove the client and this server to each other, and read the request, by
        ``deadline``."""
        challenge = auth.nonce()
        connection.settimeout(max(0.0, deadline - time.monotonic()))
        connection.sendall(challenge)
        answer = _read_exactly(connection, 2 * auth.NONCE_BYTES, deadline)
        proof, theirs = answer[: auth.NONCE_BYTES], answer[auth.NONCE_BYTES :]
        if not auth.verify(self._key, b"client", challenge, proof):
            raise Refused("without the job's key", "no proof of the job's key (a wrong one)")
        connection.sendall(auth.proof(self._key, b"server", theirs))
        kind = _read_exactly(connection, 1, deadline)
        fields = {b"P": _PUSH, b"G": _PULL}.get(kind)
        if fields is None:
            raise ValueError(f"a request of kind {kind!r} is not one relaunch sends")
        raw = kind + _read_exactly(connection, fields.size - 1, deadline)
        return _Request(_session(self._key, challenge, theirs), raw)

    def _serve(self, connection: socket.socket, peer: str, request: _Request) -> None:
        if request.raw[:1] == b"P":
            self._receive(connection, peer, request)
        else:
            self._send_pulled(connection, request)

    def _receive(self, connection: socket.socket, peer: str, request: _Request) -> None:
        rank, slot, size = _PUSH.unpack(request.raw)[1:]
        if rank >= _MAX_RANK or slot not in layout.SLOTS:
            raise ValueError(f"a push of rank {rank} slot {slot} is not one relaunch sends")
        if not layout.HEADER_SIZE <= size <= self.limit:
            raise ValueError(f"a push of {size} bytes is more than the state memory holds")
        mac = _mac(request, b"push")
        head = _read_exactly(connection, layout.HEADER_SIZE)
        mac.update(head)
        with self._receiving_copy(rank):
            peers = os.path.join(self.directory, PEERS)
            copies = {n: h for n, h in committed(peers, rank).items() if n in layout.SLOTS[:2]}
            path = os.path.join(peers, layout.slot_name(rank, layout.slot_to_write(copies, 1)))
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                write_all(fd, bytes(layout.HEADER_SIZE), 0)  # uncommitted while rewritten
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                _receive_into(connection, fd, layout.HEADER_SIZE, size, mac)
                whole = _read_exactly(connection, 1)
                mac.update(whole)
                proved = hmac.compare_digest(mac.digest(), _read_exactly(connection, _MAC_BYTES))
                if not proved:
                    self.server.refuse(
                        peer,
                        Refused(
                            "with copies that failed their check",
                            f"its copy of rank {rank}'s state failed its check: not kept",
                        ),
                    )
                elif whole == b"\1" and layout.read_header(head) is not None:
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

    def _send_pulled(self, connection: socket.socket, request: _Request) -> None:
        _, rank, step = _PULL.unpack(request.raw)
        path = None if rank >= _MAX_RANK else find_slot(self.directory, rank, step)
        fd = -1 if path is None else os.open(path, os.O_RDONLY)
        try:
            head = None if fd < 0 else slot_header(fd)
            size = 0 if head is None or head.step != step else head.size
            mac = _mac(request, b"pull")
            mac.update(_SIZE.pack(size))
            connection.sendall(_SIZE.pack(size))
            if size:
                _send_file(connection, fd, size, mac)
            connection.sendall(mac.digest())
        finally:
            if fd >= 0:
                os.close(fd)

    # -- the client -----------------------------------------------------------------------

    def follow(self, successors: list[str]) -> None:
        """Push to ``successors`` (their addresses) from now on, each save whether it was
        copied before or not (a re-formed world forgot the copies of later steps, and a step of
        its own may have a generation the forgotten one had)."""
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
                    log.debug("could not copy rank %d's state to %s: %s", rank, successor, exc)

    def _push(self, rank: int, successor: str, holds: int) -> None:
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
            if self._copied.get((rank, successor)) == head.generation:
                return  # copied there already (saves between copy steps call here too)
        path = os.path.join(self.directory, layout.slot_name(rank, slot))
        began = time.monotonic()
        fd = os.open(path, os.O_RDONLY)
        try:
            with self._connect(successor) as (connection, session):
                with self._wanted:
                    if self._holds != holds:
                        return  # held since this push was chosen
                    self._pushing = connection
                request = _Request(session, _PUSH.pack(b"P", rank, slot, head.size))
                connection.sendall(request.raw)
                mac = _mac(request, b"push")
                _send_file(connection, fd, head.size, mac)
                again = slot_header(fd)
                whole = again is not None and again.generation == head.generation
                mac.update(b"\1" if whole else b"\0")
                connection.sendall((b"\1" if whole else b"\0") + mac.digest())
                connection.shutdown(socket.SHUT_WR)
                connection.recv(1)  # the receiver's close: the copy is committed there
            if whole:
                with self._wanted:
                    self._copied[(rank, successor)] = head.generation
            if not head.replicated:
                self._say_if_slow(rank, successor, head, time.monotonic() - began, whole)
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

    def pull(self, holder: str, rank: int, step: int, target: str) -> bool:
        """Fetch ``rank``'s state of ``step`` from ``holder`` (its address) into the slot
        file ``target``; whether it came (``ValueError`` when it failed its check)."""
        with self._connect(holder) as (connection, session):
            request = _Request(session, _PULL.pack(b"G", rank, step))
            connection.sendall(request.raw)
            mac = _mac(request, b"pull")
            raw_size = _read_exactly(connection, _SIZE.size)
            mac.update(raw_size)
            (size,) = _SIZE.unpack(raw_size)
            if not layout.HEADER_SIZE <= size <= self.limit:
                return False
            temporary = f"{target}.pull"
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _receive_into(connection, fd, 0, size, mac)
                if not hmac.compare_digest(mac.digest(), _read_exactly(connection, _MAC_BYTES)):
                    raise ValueError(f"what {holder} sent failed its check: not kept")
            except BaseException:
                os.close(fd)
                os.unlink(temporary)
                raise
            os.close(fd)
            os.replace(temporary, target)
            return True

    @contextlib.contextmanager
    def _connect(self, address: str) -> Iterator[tuple[socket.socket, bytes]]:
        """A connection to the peer at ``address`` once each end proved the job's key to
        the other, and its session key (``_session``)."""
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=IO_TIMEOUT) as connection:
            challenge = _read_exactly(connection, auth.NONCE_BYTES)
            mine = auth.nonce()
            connection.sendall(auth.proof(self._key, b"client", challenge) + mine)
            if not auth.verify(
                self._key, b"server", mine, _read_exactly(connection, auth.NONCE_BYTES)
            ):
                raise ValueError(f"the state peer at {address} does not know the job's key")
            yield connection, _session(self._key, challenge, mine)

    def close(self) -> None:
        with self._wanted:
            self._closing = True
            self._wanted.notify()
        self.server.close()
        self._pusher.join()


def _session(key: str, server: bytes, client: bytes) -> bytes:
    """The key of one connection: from the job's and both ends' nonces, so that no byte of
    another connection checks out on it."""
    return auth.proof(key, b"session", server + client)


def _mac(request: _Request, direction: bytes) -> hmac.HMAC:
    """The HMAC of what follows ``request`` in ``direction`` (b"push" or b"pull")."""
    return hmac.new(request.session, direction + b":" + request.raw, hashlib.sha256)


def _send_file(connection: socket.socket, fd: int, size: int, mac: hmac.HMAC) -> None:
    """``size`` bytes of file ``fd`` from its start, each also into ``mac``."""
    buffer = bytearray(min(_CHUNK, size))
    offset = 0
    while offset < size:
        view = memoryview(buffer)[: min(len(buffer), size - offset)]
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise ValueError("the slot ended before its header says")
        mac.update(view[:got])
        connection.sendall(view[:got])
        offset += got


def _receive_into(
    connection: socket.socket, fd: int, offset: int, end: int, mac: hmac.HMAC
) -> None:
    """The bytes ``offset`` to ``end`` of a slot file, from ``connection`` into file ``fd``,
    each also into ``mac``."""
    buffer = bytearray(min(_CHUNK, max(0, end - offset)))
    while offset < end:
        view = memoryview(buffer)[: min(len(buffer), end - offset)]
        _read_into(connection, view)
        mac.update(view)
        write_all(fd, view, offset)
        offset += len(view)


def _read_exactly(connection: socket.socket, size: int, deadline: float | None = None) -> bytes:
    data = bytearray(size)
    _read_into(connection, memoryview(data), deadline)
    return bytes(data)


def _read_into(connection: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``connection``: by ``deadline`` (``time.monotonic``) when given, all
    reads together, else with the connection's timeout a read."""
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            connection.settimeout(left)
        got = connection.recv_into(view)
        if got == 0:
            raise ValueError("the peer closed the connection")
        view = view[got:]
