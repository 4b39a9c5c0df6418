"""torch's ``TCPStore`` wire protocol, pure: a client's requests decoded from its bytes, and
the replies encoded (``store.torch_wire`` serves them).

A request is one byte (its query type) and its fields, little-endian as torch's client writes
them on every machine it runs on: a key or a value is an unsigned 64-bit length and its bytes;
a count an unsigned 64-bit number; ``ADD``'s delta and ``BARRIER``'s world size a signed one;
``VALIDATE``'s magic and ``PING``'s nonce 32 bits. A client first sends ``VALIDATE`` (the
magic) and ``PING`` (a nonce the server sends back). The caps are torch's own server's
(``TCPStoreLibUvBackend``: keys of 8 KiB, values of 8 MiB, 128 Ki keys a request): whatever a
job sends torchrun's store fits, and a request past them closes its connection, as there.
"""

from __future__ import annotations

import struct
from typing import Any

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY = range(9)
APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT, PING = range(9, 14)
QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER = range(14, 19)

#: What a client's ``VALIDATE`` carries.
MAGIC = 0x3C85F7CE
#: ``CHECK``'s replies.
READY, NOT_READY = 0, 1
#: ``WAIT``'s and ``BARRIER``'s replies, and ``CANCEL_WAIT``'s.
STOP_WAITING, WAIT_CANCELED = 0, 1

#: The longest key, the longest value and the most keys a request may carry (torch's caps).
MAX_KEY = 8 << 10
MAX_VALUE = 8 << 20
MAX_KEYS = 128 << 10
#: The longest request: eight of the largest values (``MULTI_SET``) and their keys.
MAX_REQUEST = 8 * (MAX_VALUE + MAX_KEY + 16) + 16

#: Each query's fields, in order: k a key, v a value, i a signed and n a 32-bit number,
#: K a count and that many keys, P a count and that many keys and values.
FIELDS: dict[int, str] = {
    VALIDATE: "n",
    SET: "kv",
    COMPARE_SET: "kvv",
    GET: "k",
    ADD: "ki",
    CHECK: "K",
    WAIT: "K",
    GETNUMKEYS: "",
    DELETE_KEY: "k",
    APPEND: "kv",
    MULTI_GET: "K",
    MULTI_SET: "P",
    CANCEL_WAIT: "",
    PING: "n",
    QUEUE_PUSH: "kv",
    QUEUE_POP: "k",
    QUEUE_LEN: "k",
    LIST_KEYS: "",
    BARRIER: "ki",
}

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

Request = tuple[int, tuple[Any, ...], int]


class BadRequest(Exception):
    """A request torch's client never sends, or past a cap: its connection is closed.
    ``reason``: a short name for the log's summary."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _Short(Exception):
    """The buffer ends inside the request: more bytes are needed."""


class Scanner:
    """Where a request ends, found as its bytes come: each ``end`` goes on from where the last
    stopped, so that a request that arrives in many reads is looked at once, byte for byte
    (``parse`` then decodes it whole). Caps are checked as each length is read."""

    __slots__ = ("at", "start", "steps")

    def __init__(self) -> None:
        self.start = -1  # where the request scanned begins; -1: none begun
        self.at = 0  # how far it is scanned
        self.steps: list[str] = []  # the fields still to scan, the next last

    def end(self, data: bytes | bytearray, start: int) -> int | None:
        """Where the request at ``start`` of ``data`` ends; None while it is incomplete."""
        if self.start != start:
            if start >= len(data):
                return None
            kinds = FIELDS.get(data[start])
            if kinds is None:
                raise BadRequest("unknown query", f"an unknown query type {data[start]}")
            self.start, self.at, self.steps = start, start + 1, list(reversed(kinds))
        steps, size = self.steps, len(data)
        while steps:
            kind = steps[-1]
            width = 4 if kind == "n" else 8
            if self.at + width > size:
                return None
            if kind in "kv":
                length = _U64.unpack_from(data, self.at)[0]
                most, what = (MAX_KEY, "key") if kind == "k" else (MAX_VALUE, "value")
                if length > most:
                    raise BadRequest(
                        f"{what} too long", f"a {what} of {length} bytes (at most {most})"
                    )
                if self.at + width + length - start > MAX_REQUEST:
                    raise BadRequest("request too long", f"a request over {MAX_REQUEST} bytes")
                if self.at + width + length > size:
                    return None
                width += length
            steps.pop()
            if kind in "KP":
                count = _U64.unpack_from(data, self.at)[0]
                if count > MAX_KEYS:
                    raise BadRequest(
                        "too many keys", f"{count} keys in a request (at most {MAX_KEYS})"
                    )
                steps.extend(["k"] * count if kind == "K" else ["v", "k"] * count)
            self.at += width
        self.start = -1
        return self.at

    def moved(self, by: int) -> None:
        """The buffer lost its first ``by`` bytes (those of the requests before this one)."""
        if self.start >= 0:
            self.start -= by
            self.at -= by


def parse(data: bytes | bytearray, start: int = 0) -> Request | None:
    """The request at ``start`` of ``data``: its query type, its fields (bytes, ints, a tuple
    of keys, or of (key, value) pairs) and where it ends; None while it is incomplete.
    BadRequest for an unknown query type or a field past a cap, as soon as it is seen. (No
    view of ``data`` outlives the call: its owner may resize it.)"""
    if start >= len(data):
        return None
    query = data[start]
    fields = FIELDS.get(query)
    if fields is None:
        raise BadRequest("unknown query", f"an unknown query type {query}")
    reader = _Reader(data, start)
    try:
        values = tuple(reader.field(kind) for kind in fields)
    except _Short:
        return None
    return query, values, reader.at


class _Reader:
    __slots__ = ("at", "begin", "data")

    def __init__(self, data: bytes | bytearray, start: int) -> None:
        self.data, self.begin, self.at = data, start, start + 1

    def _number(self, shape: struct.Struct) -> int:
        if self.at + shape.size > len(self.data):
            raise _Short
        (value,) = shape.unpack_from(self.data, self.at)
        self.at += shape.size
        return int(value)

    def _bytes(self, most: int, what: str) -> bytes:
        size = self._number(_U64)
        if size > most:
            raise BadRequest(f"{what} too long", f"a {what} of {size} bytes (at most {most})")
        end = self.at + size
        if end - self.begin > MAX_REQUEST:
            raise BadRequest("request too long", f"a request over {MAX_REQUEST} bytes")
        if end > len(self.data):
            raise _Short
        piece, self.at = bytes(self.data[self.at : end]), end
        return piece

    def _count(self) -> int:
        count = self._number(_U64)
        if count > MAX_KEYS:
            raise BadRequest("too many keys", f"{count} keys in a request (at most {MAX_KEYS})")
        return count

    def field(self, kind: str) -> object:
        if kind == "k":
            return self._bytes(MAX_KEY, "key")
        if kind == "v":
            return self._bytes(MAX_VALUE, "value")
        if kind == "i":
            return self._number(_I64)
        if kind == "n":
            return self._number(_U32)
        if kind == "K":
            return tuple(self._bytes(MAX_KEY, "key") for _ in range(self._count()))
        pairs = []
        for _ in range(self._count()):
            key = self._bytes(MAX_KEY, "key")
            pairs.append((key, self._bytes(MAX_VALUE, "value")))
        return tuple(pairs)


def blob(value: bytes) -> bytes:
    """A value (or key) as a reply carries it: its length, then its bytes."""
    return _U64.pack(len(value)) + value


def int64(value: int) -> bytes:
    return _I64.pack(value)


def nonce(value: int) -> bytes:
    return _U32.pack(value)


def added(current: bytes | None, delta: int) -> int:
    """``ADD``'s new value: ``current`` (decimal digits, as ``ADD`` stores them; None: none)
    plus ``delta``. BadRequest when ``current`` is no number or the sum leaves 64 bits."""
    total = delta
    if current is not None:
        try:
            total += int(current.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise BadRequest("add to no number", "ADD to a value that is no number") from None
    if not _I64_MIN <= total <= _I64_MAX:
        raise BadRequest("add overflow", "ADD past a signed 64-bit number")
    return total
