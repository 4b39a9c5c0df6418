"""torch's ``TCPStore`` requests decoded (``store.torch_wire_shapes``): whole or in pieces,
found once (a request that comes in many reads is not scanned again from its start), and caps
refused as soon as a length says so."""

from __future__ import annotations

import time

import pytest

import relaunch.store.torch_wire_shapes as wire
from relaunch.store.torch_wire_shapes import BadRequest, Scanner, parse


def multi_set(pairs: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(wire.blob(key) + wire.blob(value) for key, value in pairs)
    return bytes([wire.MULTI_SET]) + wire.int64(len(pairs)) + body


def test_a_request_is_decoded_whole_and_found_in_pieces() -> None:
    request = multi_set([(b"/a", b"1"), (b"/b", b"22")]) + bytes([wire.GETNUMKEYS])
    assert parse(request) == (wire.MULTI_SET, (((b"/a", b"1"), (b"/b", b"22")),), len(request) - 1)
    assert parse(request, len(request) - 1) == (wire.GETNUMKEYS, (), len(request))
    scanner, data = Scanner(), bytearray()
    for byte in request[:-1]:
        assert scanner.end(data, 0) is None
        data.append(byte)
    assert scanner.end(data, 0) == len(request) - 1


def test_many_keys_in_many_reads_are_scanned_once() -> None:
    """128 Ki keys arriving 4 KiB at a time: every field is looked at once, not once a read."""
    request = bytes([wire.WAIT]) + wire.int64(wire.MAX_KEYS)
    request += b"".join(wire.blob(b"%06d" % n) for n in range(wire.MAX_KEYS))
    scanner, data = Scanner(), bytearray()
    started = time.process_time()
    for at in range(0, len(request), 4096):
        assert scanner.end(data, 0) is None
        data += request[at : at + 4096]
    assert scanner.end(data, 0) == len(request)
    assert time.process_time() - started < 5  # once over: about 0.1 s; once a read: minutes


@pytest.mark.parametrize(
    "request_bytes, reason",
    [
        (bytes([99]), "unknown query"),
        (bytes([wire.GET]) + wire.int64(wire.MAX_KEY + 1), "key too long"),
        (bytes([wire.SET]) + wire.blob(b"k") + wire.int64(wire.MAX_VALUE + 1), "value too long"),
        (bytes([wire.CHECK]) + wire.int64(wire.MAX_KEYS + 1), "too many keys"),
        (multi_set([(b"k", b"")] * 8), None),  # within every cap
    ],
)
def test_caps_are_refused_as_soon_as_a_length_says_so(
    request_bytes: bytes, reason: str | None
) -> None:
    if reason is None:
        assert Scanner().end(request_bytes, 0) == len(request_bytes)
        return
    with pytest.raises(BadRequest) as refused:
        Scanner().end(request_bytes, 0)
    assert refused.value.reason == reason


def test_a_request_past_the_longest_is_refused_before_its_bytes_come() -> None:
    value = wire.int64(wire.MAX_VALUE)
    head = bytes([wire.MULTI_SET]) + wire.int64(9)
    pieces = head + b"".join(wire.blob(b"k") + value + b"x" * wire.MAX_VALUE for _ in range(8))
    with pytest.raises(BadRequest) as refused:
        Scanner().end(pieces + wire.blob(b"k") + value, 0)
    assert refused.value.reason == "request too long"


def test_add_keeps_to_64_bits_and_numbers() -> None:
    assert wire.added(None, 5) == 5 and wire.added(b"-3", 5) == 2
    with pytest.raises(BadRequest):
        wire.added(b"x", 1)
    with pytest.raises(BadRequest):
        wire.added(str((1 << 63) - 1).encode(), 1)
