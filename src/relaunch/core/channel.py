"""The agent-worker channel's layout: a small shared-memory file, one slot per local rank.

The agent creates the file and names it in ``RELAUNCH_CHANNEL``; each worker maps it. Workers
write their progress into their own slot and read the stop flag: no syscall, no lock, nothing
that can block a training loop. The agent reads the slots when it draws its progress bar.

Layout (little-endian)::

    header  0: magic  8s  |  8: stop flag u32  | 12: slots u32
           16: failure pending u8 (a rank failed: save now, ``relaunch.failure_pending``)
           17..64 reserved
    slot i  at HEADER + i * SLOT:
      progress (``report_progress``):
            0: sequence u64 (odd while the worker writes: a seqlock)
            8: step i64  | 16: total i64 (-1: unknown) | 24: time f64 (when reported)
           32: listening u8 (the worker has asked ``stop_requested()``: it will stop on its own)
           33: listening for failures u8 (it asked ``failure_pending()`` or gave a callback)
           40: description, UTF-8, NUL-padded to DESC bytes
      liveness (``heartbeat``, ``section``), at LIVE_OFFSET, a seqlock of its own:
          128: sequence u64
          136: last heartbeat f64 | 144: next heartbeat due f64 | 152: section entered f64
          160: section due f64 | 168: sections completed u64 | 176: heartbeats u64
          184: how the section's bound was set u8 | 185: the heartbeat's u8 (BOUND_*)
          192: the open section's name, UTF-8, NUL-padded to NAME bytes
      recovery (``load_state``, ``report_progress``), at RECOVERY_OFFSET:
          256: load_state began f64 | 264: load_state ended f64 (written last)
          272: the step it restored i64 (-1: none) | 280: seconds a step takes f64 (a moving
          average of the reports') | 288..320 reserved

Times are ``time.time()``; 0 means none (no heartbeat yet, no section open, no bound).
"""

from __future__ import annotations

import struct

CHANNEL_ENV = "RELAUNCH_CHANNEL"
MAGIC = b"RLCHAN3\0"
HEADER = 64
SLOT = 320
DESC_OFFSET = 40
DESC_END = 128
DESC = DESC_END - DESC_OFFSET
LISTENING_OFFSET = 32
FAILURE_LISTENING_OFFSET = 33
STOP_OFFSET = 8
FAILURE_OFFSET = 16
LIVE_OFFSET = 128
NAME_OFFSET = LIVE_OFFSET + 64
NAME_END = 256
NAME = NAME_END - NAME_OFFSET
RECOVERY_OFFSET = 256
STEP_SECONDS_OFFSET = RECOVERY_OFFSET + 24

#: How a deadline in the liveness block was set.
BOUND_NONE, BOUND_GIVEN, BOUND_LEARNED = 0, 1, 2

HEADER_STRUCT = struct.Struct("<8sII")
SEQ = struct.Struct("<Q")
FIELDS = struct.Struct("<qqd")
LIVE_FIELDS = struct.Struct("<ddddQQBB")
RESTORE = struct.Struct("<ddq")
F64 = struct.Struct("<d")


def size(slots: int) -> int:
    """Bytes of a channel with ``slots`` local ranks."""
    return HEADER + slots * SLOT


def slot_offset(rank: int) -> int:
    return HEADER + rank * SLOT


def listening(buffer: bytes | bytearray | memoryview, rank: int) -> bool:
    """Whether ``rank`` has asked ``stop_requested()``: a stop request will be heard."""
    return buffer[slot_offset(rank) + LISTENING_OFFSET] != 0


def failure_listening(buffer: bytes | bytearray | memoryview, rank: int) -> bool:
    """Whether ``rank`` will hear that a failure is pending (``failure_pending()``)."""
    return buffer[slot_offset(rank) + FAILURE_LISTENING_OFFSET] != 0


def pending_path(path: str, rank: int) -> str:
    """The FIFO beside the channel ``path`` on which the agent wakes local rank ``rank``'s
    ``on_failure_pending`` callback (one byte)."""
    return f"{path}.pending{rank}"


def bounds_path(path: str, rank: int) -> str:
    """The file beside the channel ``path`` where local rank ``rank`` keeps the bounds it
    learned (``core.sections.encode_learned``), for its agent to keep for the job."""
    return f"{path}.bounds{rank}"


def wake_path(path: str) -> str:
    """The FIFO beside the channel ``path`` that a worker writes one byte to, to wake its agent,
    when its slot gets its first progress report, and when it first uses heartbeats or
    sections."""
    return path + ".wake"


def encode_desc(desc: str, width: int = DESC) -> bytes:
    """``desc`` as the slot stores it: at most ``width`` bytes, cut on a character boundary."""
    data = desc.encode("utf-8")[:width]
    return data.decode("utf-8", errors="ignore").encode("utf-8").ljust(width, b"\0")
