"""The built-in store's wire format: length-prefixed frames of length-prefixed fields.

A frame is a 4-byte big-endian payload length, then the payload: one byte (the operation in a
request, the status in a reply), a one-byte field count, and each field as a 4-byte big-endian
length and its bytes. Integers travel as decimal ASCII. Frames over ``MAX_FRAME`` bytes are a
protocol error: the receiver closes the connection.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence

from relaunch.store.api import StoreProtocolError

MAX_FRAME = 16 * 1024 * 1024
#: The largest value a store keeps: small enough that any reply carrying it fits in a frame.
MAX_VALUE = MAX_FRAME - 4096
MAX_FIELDS = 255
PROTOCOL = b"relaunch-store/1"

_LENGTH = struct.Struct(">I")

# Operations (requests) ...
HELLO, AUTH, GET, SET, CAS, ADD, DELETE, WAIT, WATCH, PING = range(1, 11)
# ... those between stores: a standby follows its primary, and is asked to take over ...
REPLICATE, PROMOTE = 11, 12
# ... several keys read in one request (at most ``MAX_GETS``) ...
GETS = 13
MAX_GETS = MAX_FIELDS // 3
# ... and statuses (replies): REDIRECT (a standby: ask the primary it names), FENCED (a store
# that lost the job's majority: it serves nobody).
OK, ERROR, TIMEOUT, REDIRECT, FENCED = 0, 1, 2, 3, 4
#: The kinds of a replication stream's records: a key's value and version, a key deleted at a
#: revision, the snapshot's end and its revision.
RECORD_KEY, RECORD_DELETED, RECORD_SYNCED = b"k", b"d", b"r"


def encode(code: int, fields: Sequence[bytes] = ()) -> bytes:
    """One frame: ``code`` and ``fields``, ready to send."""
    if len(fields) > MAX_FIELDS:
        raise StoreProtocolError(f"too many fields: {len(fields)}")
    parts = [bytes((code, len(fields)))]
    for field in fields:
        parts.append(_LENGTH.pack(len(field)))
        parts.append(field)
    payload = b"".join(parts)
    if len(payload) > MAX_FRAME:
        raise StoreProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _LENGTH.pack(len(payload)) + payload


def decode_payload(payload: bytes | bytearray | mmap.mmap) -> tuple[int, list[bytes]]:
    """The code and fields of one frame's payload; StoreProtocolError if malformed. Only the
    fields are copied, so a large frame costs its buffer and its value, not copies of both."""
    with memoryview(payload) as view:
        if len(view) < 2:
            raise StoreProtocolError("frame too short")
        code, count = view[0], view[1]
        fields, offset = [], 2
        for _ in range(count):
            if offset + 4 > len(view):
                raise StoreProtocolError("truncated field length")
            (size,) = _LENGTH.unpack_from(view, offset)
            offset += 4
            if offset + size > len(view):
                raise StoreProtocolError("truncated field")
            fields.append(bytes(view[offset : offset + size]))
            offset += size
        if offset != len(view):
            raise StoreProtocolError("trailing bytes after the last field")
    return code, fields


class FrameReader:
    """Accumulates received bytes and yields complete frames' payloads.

    ``push`` then ``next`` hands out one frame at a time, so that a server can stop taking a
    client's requests (backpressure) with the rest still buffered; ``feed`` takes them all.
    Consumed bytes are dropped in one go, not frame by frame: a buffer of thousands of
    pipelined frames costs linear time, not quadratic.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._start = 0  # where the next frame begins in _buffer

    def push(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes."""
        if self._start:
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    def next(self) -> bytes | None:
        """The next complete frame's payload, or None until more bytes arrive."""
        buffer, start = self._buffer, self._start
        if len(buffer) - start < 4:
            return None
        (size,) = _LENGTH.unpack_from(buffer, start)
        if size > MAX_FRAME:
            raise StoreProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
        end = start + 4 + size
        if len(buffer) < end:
            return None
        with memoryview(buffer) as view:
            payload = bytes(view[start + 4 : end])
        if end == len(buffer):
            buffer.clear()  # frees the memory: an idle connection keeps no buffer
            self._start = 0
        else:
            self._start = end
        return payload

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Append ``data``; every complete frame's payload now buffered."""
        self.push(data)
        frames = []
        while (payload := self.next()) is not None:
            frames.append(payload)
        return frames


def to_int(field: bytes) -> int:
    """A decimal integer field; ``StoreProtocolError`` for anything else (Python refuses a
    field of over 4,300 digits before parsing it)."""
    try:
        return int(field)
    except ValueError:
        raise StoreProtocolError(f"expected an integer field, got {field[:20]!r}") from None


def from_int(value: int) -> bytes:
    return str(value).encode()
