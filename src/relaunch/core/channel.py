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
          average of the reports') | 288: saves committed u64 (``save_state``) | 296..320
          reserved
      sections' time (``section``; what stragglers are judged on), at TIMES_OFFSET: TIMES
      entries of TIME_ENTRY bytes, one per section name in the order first ended, each a seqlock
      of its own:
          0: sequence u64 | 8: seconds spent in it f64 | 16: runs ended u64
          24: the name, UTF-8, NUL-padded to TIME_NAME bytes
    learned bounds of rank i (``relaunch.worker``, ``core.sections.encode_learned``), two
    copies, the newer named by the head; the heads lie together (one page to read them all),
    the tables after them:
      head at HEADER + slots * SLOT + i * LEARNED_HEAD:
            0: the newer copy u8 (0 or 1) | 8 + 16 * c: copy c's sequence u64 (odd while
            written, 0: never) | 16 + 16 * c: its length u64
      copy c at HEADER + slots * (SLOT + LEARNED_HEAD) + (2 * i + c) * COPY: the table, JSON

The workers wake their agent with one byte on the wake FIFO (``wake_path``): ``SAVED`` after a
save (the agent reads the slots' counts of saves), any other at a first use of the channel (its
steps are worth sampling, its deadlines watching).

Times are ``time.time()``; 0 means none (no heartbeat yet, no section open, no bound).
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False  # not typing's: a worker imports this module
if TYPE_CHECKING:
    from mmap import mmap

CHANNEL_ENV = "RELAUNCH_CHANNEL"
MAGIC = b"RLCHAN5\0"
HEADER = 64
SLOT = 512
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
SAVES_OFFSET = RECOVERY_OFFSET + 32
#: The sections' time: the first ``TIMES`` names a worker's sections ended with, each entry
#: ``TIME_ENTRY`` bytes, its name cut to ``TIME_NAME``.
TIMES_OFFSET = 320
TIMES = 4
TIME_ENTRY = 48
TIME_NAME = TIME_ENTRY - 24
#: Bytes of the head of a rank's learned bounds, and of each of their two copies.
LEARNED_HEAD = 64
COPY = 32 << 10
#: The byte a worker wakes its agent with after a committed save.
SAVED = b"s"

#: How a deadline in the liveness block was set.
BOUND_NONE, BOUND_GIVEN, BOUND_LEARNED = 0, 1, 2

HEADER_STRUCT = struct.Struct("<8sII")
SEQ = struct.Struct("<Q")
FIELDS = struct.Struct("<qqd")
LIVE_FIELDS = struct.Struct("<ddddQQBB")
RESTORE = struct.Struct("<ddq")
F64 = struct.Struct("<d")
U64 = struct.Struct("<Q")
COPY_HEAD = struct.Struct("<QQ")
TIME_FIELDS = struct.Struct("<dQ")


def size(slots: int) -> int:
    """Bytes of a channel with ``slots`` local ranks."""
    return HEADER + slots * (SLOT + LEARNED_HEAD + 2 * COPY)


def learned_offsets(slots: int, rank: int) -> tuple[int, int]:
    """Where the head of ``rank``'s learned bounds lies in a channel of ``slots`` ranks, and
    where their first copy does."""
    heads = HEADER + slots * SLOT
    return heads + rank * LEARNED_HEAD, heads + slots * LEARNED_HEAD + 2 * rank * COPY


def read_learned(buffer: bytes | bytearray | memoryview, at: tuple[int, int]) -> bytes:
    """The newest whole table of learned bounds at ``at`` (``learned_offsets``); b"" when none
    is whole (none written, or a writer died midway through both copies)."""
    head, start = at
    newer = buffer[head] & 1
    for copy in (newer, 1 - newer):
        sequence, length = COPY_HEAD.unpack_from(buffer, head + 8 + 16 * copy)
        if not sequence and copy == newer:
            return b""  # the newer copy never written: no write ever ended
        if sequence % 2 or not sequence or length > COPY:
            continue
        data = bytes(buffer[start + copy * COPY : start + copy * COPY + length])
        if COPY_HEAD.unpack_from(buffer, head + 8 + 16 * copy)[0] == sequence:
            return data
    return b""


def write_learned(buffer: bytearray | memoryview | mmap, at: tuple[int, int], data: bytes) -> bool:
    """Write ``data`` (a table of learned bounds) over the older copy at ``at``, then name it
    the newer: a writer killed midway leaves the other whole. False when it does not fit."""
    if len(data) > COPY:
        return False
    head, start = at
    copy = 1 - (buffer[head] & 1)
    sequence = COPY_HEAD.unpack_from(buffer, head + 8 + 16 * copy)[0]
    sequence += 1 + sequence % 2  # odd: being written
    COPY_HEAD.pack_into(buffer, head + 8 + 16 * copy, sequence, 0)
    buffer[start + copy * COPY : start + copy * COPY + len(data)] = data
    COPY_HEAD.pack_into(buffer, head + 8 + 16 * copy, sequence + 1, len(data))
    buffer[head] = copy
    return True


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


def wake_path(path: str) -> str:
    """The FIFO beside the channel ``path`` that a worker writes one byte to, to wake its agent:
    when its slot gets its first progress report, when it first uses heartbeats or sections,
    and after each committed save (``SAVED``)."""
    return path + ".wake"


def encode_desc(desc: str, width: int = DESC) -> bytes:
    """``desc`` as the slot stores it: at most ``width`` bytes, cut on a character boundary."""
    data = desc.encode("utf-8")[:width]
    return data.decode("utf-8", errors="ignore").encode("utf-8").ljust(width, b"\0")
