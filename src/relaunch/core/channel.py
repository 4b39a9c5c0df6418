"""The agent-worker channel's layout: a small shared-memory file, one slot per local rank.

The agent creates the file and names it in ``RELAUNCH_CHANNEL``; each worker maps it. Workers
write their progress into their own slot and read the stop flag: no syscall, no lock, nothing
that can block a training loop. The agent reads the slots when it draws its progress bar.

Layout (little-endian)::

    header  0: magic  8s  |  8: stop flag u32  | 12: slots u32  | 16..64 reserved
    slot i  at HEADER + i * SLOT:
            0: sequence u64 (odd while the worker writes: a seqlock)
            8: step i64  | 16: total i64 (-1: unknown) | 24: time f64 (when reported)
           32: listening u8 (the worker has asked ``stop_requested()``: it will stop on its own)
           40: description, UTF-8, NUL-padded to DESC bytes
"""

from __future__ import annotations

import struct

CHANNEL_ENV = "RELAUNCH_CHANNEL"
MAGIC = b"RLCHAN1\0"
HEADER = 64
SLOT = 128
DESC_OFFSET = 40
DESC = SLOT - DESC_OFFSET
LISTENING_OFFSET = 32
STOP_OFFSET = 8

HEADER_STRUCT = struct.Struct("<8sII")
SEQ = struct.Struct("<Q")
FIELDS = struct.Struct("<qqd")


def size(slots: int) -> int:
    """Bytes of a channel with ``slots`` local ranks."""
    return HEADER + slots * SLOT


def slot_offset(rank: int) -> int:
    return HEADER + rank * SLOT


def listening(buffer: bytes | bytearray | memoryview, rank: int) -> bool:
    """Whether ``rank`` has asked ``stop_requested()``: a stop request will be heard."""
    return buffer[slot_offset(rank) + LISTENING_OFFSET] != 0


def encode_desc(desc: str) -> bytes:
    """``desc`` as the slot stores it: at most ``DESC`` bytes, cut on a character boundary."""
    data = desc.encode("utf-8")[:DESC]
    return data.decode("utf-8", errors="ignore").encode("utf-8").ljust(DESC, b"\0")
