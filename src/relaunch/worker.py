"""What a worker calls to talk to its agent: ``report_progress`` and ``stop_requested``.

Both cost a microsecond or less, never block, and do nothing outside relaunch, so training
code can call them every step unconditionally.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

from relaunch.core import channel

_UNKNOWN, _OPEN, _ABSENT = 0, 1, 2
_state = _UNKNOWN
_map: mmap.mmap | None = None
_offset = 0
_sequence = 0
_desc_cache: tuple[str, bytes] = ("", channel.encode_desc(""))
_listening = False
_FIELDS = channel.FIELDS
_SEQ = channel.SEQ
_time = time.time


def _forget() -> None:
    """In a forked child: look at the channel afresh on the next call."""
    global _state
    _state = _UNKNOWN


os.register_at_fork(after_in_child=_forget)


def _open() -> mmap.mmap | None:
    """Map the agent's channel, once per process; None when not run by relaunch."""
    global _map, _offset, _sequence, _listening, _state
    _map, _sequence, _listening, _state = None, 0, False, _ABSENT
    path = os.environ.get(channel.CHANNEL_ENV)
    rank = os.environ.get("LOCAL_RANK")
    if not path or rank is None or not rank.isdigit():
        return None
    try:
        with open(path, "r+b") as file:
            mapped = mmap.mmap(file.fileno(), 0)
    except (OSError, ValueError):
        return None
    header = channel.HEADER_STRUCT.unpack_from(mapped, 0)
    if header[0] != channel.MAGIC or int(rank) >= header[2]:
        mapped.close()
        return None
    _map, _offset, _state = mapped, channel.slot_offset(int(rank)), _OPEN
    (_sequence,) = _SEQ.unpack_from(mapped, _offset)
    _sequence += _sequence % 2
    return _map


def report_progress(step: int, total: int | None = None, desc: str | None = None) -> None:
    """Tell the agent this worker reached ``step`` (of ``total``): it draws one bar per node
    (the slowest local rank), counts it as a sign of life, and puts it in status events."""
    global _sequence, _desc_cache
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return
    mapped, offset = _map, _offset
    assert mapped is not None
    sequence = _sequence + 1
    _SEQ.pack_into(mapped, offset, sequence)  # odd: being written
    try:
        _FIELDS.pack_into(mapped, offset + 8, step, -1 if total is None else total, _time())
    except struct.error:  # a float or another number type: as an int
        _FIELDS.pack_into(
            mapped, offset + 8, int(step), -1 if total is None else int(total), _time()
        )
    if desc is not None and desc != _desc_cache[0]:
        _desc_cache = (desc, channel.encode_desc(desc))
        mapped[offset + channel.DESC_OFFSET : offset + channel.SLOT] = _desc_cache[1]
    _sequence = sequence + 1
    _SEQ.pack_into(mapped, offset, _sequence)


def stop_requested() -> bool:
    """Whether the agent asks the workers to stop (a preemption, a Ctrl-C): save a checkpoint
    at the next step boundary and exit 0. Always False outside relaunch."""
    global _listening
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return False
    mapped = _map
    assert mapped is not None
    if not _listening:  # tell the agent once that a stop request will be heard
        mapped[_offset + channel.LISTENING_OFFSET] = 1
        _listening = True
    return mapped[channel.STOP_OFFSET] != 0
