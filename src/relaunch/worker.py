"""What a worker calls to talk to its agent: ``report_progress`` and ``stop_requested``.

Both cost about a microsecond, never block, and do nothing outside relaunch, so training code
can call them every step unconditionally.
"""

from __future__ import annotations

import mmap
import os
import time

from relaunch.core import channel

_map: mmap.mmap | None = None
_offset = 0
_sequence = 0
_pid = 0
_desc_cache: tuple[str, bytes] = ("", channel.encode_desc(""))
_listening = False
_FIELDS = channel.FIELDS
_SEQ = channel.SEQ


def _open() -> mmap.mmap | None:
    """Map the agent's channel, once per process; None when not run by relaunch."""
    global _map, _offset, _sequence, _pid, _listening
    if _pid == os.getpid():
        return _map
    _pid, _map, _sequence, _listening = os.getpid(), None, 0, False
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
    _map, _offset = mapped, channel.slot_offset(int(rank))
    (_sequence,) = _SEQ.unpack_from(mapped, _offset)
    _sequence += _sequence % 2
    return _map


def report_progress(step: int, total: int | None = None, desc: str | None = None) -> None:
    """Tell the agent this worker reached ``step`` (of ``total``): it draws one bar per node
    (the slowest local rank), counts it as a sign of life, and puts it in status events."""
    global _sequence, _desc_cache
    mapped = _map if _pid == os.getpid() else _open()
    if mapped is None:
        return
    offset = _offset
    _sequence += 1
    _SEQ.pack_into(mapped, offset, _sequence)  # odd: being written
    _FIELDS.pack_into(mapped, offset + 8, int(step), -1 if total is None else int(total),
                      time.time())  # fmt: skip
    if desc is not None and desc != _desc_cache[0]:
        _desc_cache = (desc, channel.encode_desc(desc))
    mapped[offset + channel.DESC_OFFSET : offset + channel.SLOT] = _desc_cache[1]
    _sequence += 1
    _SEQ.pack_into(mapped, offset, _sequence)


def stop_requested() -> bool:
    """Whether the agent asks the workers to stop (a preemption, a Ctrl-C): save a checkpoint
    at the next step boundary and exit 0. Always False outside relaunch."""
    global _listening
    mapped = _map if _pid == os.getpid() else _open()
    if mapped is None:
        return False
    if not _listening:  # tell the agent once that a stop request will be heard
        mapped[_offset + channel.LISTENING_OFFSET] = 1
        _listening = True
    return mapped[channel.STOP_OFFSET] != 0
