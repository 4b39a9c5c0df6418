"""The messages between the agent and the zygote of ``--preload``, both sides: run in the agent
(imported) and in the zygote (read by path by ``zygote_program``), so only the standard library.

A message is its length (4 bytes, little-endian), then ``marshal`` data (version 4, which every
Python 3 reads); descriptors ride with its first byte (``SCM_RIGHTS``).
"""

import _socket
import marshal
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: A message: its length (4 bytes, little-endian), then ``marshal`` data (version 4, which every
#: Python 3 reads); descriptors ride with its first byte. The agent's requests are up to
#: ``MAX_MESSAGE`` bytes (an environment is large at most); the zygote's report on its imports is
#: read by the agent up to ``MAX_REPORT``.
HEADER = 4
MARSHAL_VERSION = 4
INT_SIZE = 4
MAX_MESSAGE = 64 << 20
MAX_REPORT = 1 << 20
#: A reply to a request, fixed-size (no marshal data from the zygote's side once workers run):
#: the request's number (8 bytes) and the forked pid (4), little-endian; its descriptors (the
#: status pipe's read end, then the child's pidfd where there are pidfds) ride with its first byte.
SEQ_SIZE = 8
REPLY_SIZE = SEQ_SIZE + INT_SIZE


def send_message(
    sock: _socket.socket, message: "Any", fds: list[int] | tuple[int, ...] = ()
) -> None:
    """Send ``message`` (marshal-able) and the descriptors ``fds`` on the stream ``sock``."""
    payload = marshal.dumps(message, MARSHAL_VERSION)
    _send(sock, len(payload).to_bytes(HEADER, "little") + payload, fds)


def send_reply(sock: _socket.socket, seq: int, pid: int, fds: list[int]) -> None:
    """Answer request ``seq``: ``pid`` forked, with the descriptors ``fds``."""
    _send(sock, seq.to_bytes(SEQ_SIZE, "little") + pid.to_bytes(INT_SIZE, "little"), fds)


def _send(sock: _socket.socket, data: bytes, fds: "list[int] | tuple[int, ...]") -> None:
    ancillary = []
    if fds:
        blob = b"".join(fd.to_bytes(INT_SIZE, sys.byteorder, signed=True) for fd in fds)
        ancillary.append((_socket.SOL_SOCKET, _socket.SCM_RIGHTS, blob))
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def received_fds(ancillary: "list[tuple[int, int, bytes]]") -> "list[int]":
    """The descriptors ``SCM_RIGHTS`` brought in a ``recvmsg``'s ancillary data (a partial
    trailing int, which a truncated message can leave, is not one)."""
    fds: list[int] = []
    for level, kind, blob in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(blob) - len(blob) % INT_SIZE
            fds.extend(
                int.from_bytes(blob[at : at + INT_SIZE], sys.byteorder, signed=True)
                for at in range(0, usable, INT_SIZE)
            )
    return fds


def receive_message(
    sock: _socket.socket, max_fds: int, max_size: int = MAX_MESSAGE
) -> "tuple[Any, list[int]] | None":
    """The next message on ``sock`` and the descriptors that came with it (close-on-exec), or
    None at the end of the stream. EOFError when the stream ends inside a message, ValueError
    when it says it is longer than ``max_size`` bytes or its data is not marshal's."""
    data, ancillary, flags, _ = sock.recvmsg(
        HEADER, _socket.CMSG_SPACE(max(1, max_fds) * INT_SIZE), _socket.MSG_CMSG_CLOEXEC
    )
    fds = received_fds(ancillary)
    try:
        if not data:
            if fds:
                raise EOFError("descriptors came without a message")
            return None
        if flags & _socket.MSG_CTRUNC:
            raise OSError("descriptors were lost in transit (MSG_CTRUNC)")
        data = _read_exactly(sock, data, HEADER)
        size = int.from_bytes(data, "little")
        if size > max_size:
            raise ValueError(f"a message of {size} bytes (at most {max_size})")
        payload = _read_exactly(sock, b"", size)
        return marshal.loads(payload), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_exactly(sock: _socket.socket, data: bytes, size: int) -> bytes:
    chunks = [data]
    left = size - len(data)
    while left > 0:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the stream ended inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
