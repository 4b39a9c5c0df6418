"""What a worker calls to talk to its agent: ``report_progress``, ``stop_requested``,
``failure_pending`` (and ``on_failure_pending``), ``heartbeat`` and ``section``; and what
``save_state`` and ``load_state`` tell it (``note_saved``, ``note_restore``).

Each costs a few microseconds at most, never blocks, and does nothing outside relaunch, so
training code can call them every step unconditionally.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import time
from _thread import allocate_lock
from types import TracebackType

from relaunch.core import channel
from relaunch.core.sections import BOUNDS_ENV, LEARN_AFTER, Learner

TYPE_CHECKING = False  # not typing's: importing typing costs a worker milliseconds
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_UNKNOWN, _OPEN, _ABSENT = 0, 1, 2
_state = _UNKNOWN
_map: mmap.mmap | None = None
_offset = 0
_learned_at = (0, 0)  # where this rank's learned bounds lie in the channel
_wake_fd = -1  # the agent's wake FIFO, opened at the first wake
_sequence = 0
_desc_cache: tuple[str, bytes] = ("", channel.encode_desc(""))
_listening = False
_failure_listening = False
_last_report: tuple[float, float] | None = None  # (step, time) of the previous report
_step_seconds = 0.0
_FIELDS = channel.FIELDS
_F64 = channel.F64
_SEQ = channel.SEQ
_time = time.time
_LIVE = channel.LIVE_FIELDS
_live_sequence = 0
_live_lock = allocate_lock()  # heartbeats may come from another thread than the sections
#: How a worker opens a path of its channel's: never through a symbolic link, never waiting.
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _forget() -> None:
    """In a forked child: look at the channel afresh on the next call."""
    global _state, _failure_listening, _last_report, _step_seconds, _wake_fd
    _state = _UNKNOWN
    if _wake_fd >= 0:  # the parent's: it goes on using its own
        os.close(_wake_fd)
        _wake_fd = -1
    _failure_listening = False
    _last_report, _step_seconds = None, 0.0
    _Live.open = []
    _Live.times = {}


os.register_at_fork(after_in_child=_forget)


def _open() -> mmap.mmap | None:
    """Map the agent's channel, once per process; None when not run by relaunch."""
    global _map, _offset, _sequence, _listening, _state, _live_sequence, _learned_at
    _map, _sequence, _listening, _state = None, 0, False, _ABSENT
    path = os.environ.get(channel.CHANNEL_ENV)
    rank = os.environ.get("LOCAL_RANK")
    if not path or rank is None or not rank.isdigit():
        return None
    try:
        fd = os.open(path, os.O_RDWR | _OPEN)
    except OSError:
        return None
    try:
        mapped = mmap.mmap(fd, 0)  # a FIFO or a device where the file should be: refused
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if len(mapped) < channel.size(1):
        mapped.close()
        return None
    header = channel.HEADER_STRUCT.unpack_from(mapped, 0)
    slots = header[2]
    if header[0] != channel.MAGIC or int(rank) >= slots or len(mapped) < channel.size(slots):
        mapped.close()
        return None
    _map, _offset, _state = mapped, channel.slot_offset(int(rank)), _OPEN
    _learned_at = channel.learned_offsets(slots, int(rank))
    (_sequence,) = _SEQ.unpack_from(mapped, _offset)
    _sequence += _sequence % 2
    (_live_sequence,) = _SEQ.unpack_from(mapped, _offset + channel.LIVE_OFFSET)
    _live_sequence += _live_sequence % 2
    _learn_from_the_job(os.environ.get(BOUNDS_ENV))
    return _map


def _learn_from_the_job(text: str | None) -> None:
    """Start from the bounds the job's workers learned before this one (``BOUNDS_ENV``): a
    restarted worker's sections and heartbeats are watched from the first."""
    if not text:
        return
    from relaunch.core.sections import decode_learned

    try:
        learned = decode_learned(text)
    except ValueError:
        return  # not the agent's: learn afresh
    with _live_lock:  # a forked child keeps what its parent learned since, too
        for name, seen in learned.sections.items():
            _Live.durations.setdefault(name, Learner()).widen(*seen)
        if learned.beats is not None:
            _Live.beat_gaps.widen(*learned.beats)


def report_progress(step: int, total: int | None = None, desc: str | None = None) -> None:
    """Tell the agent this worker reached ``step`` (of ``total``): it draws one bar per node
    (the slowest local rank), counts it as a sign of life, and puts it in status events."""
    global _sequence, _desc_cache, _last_report, _step_seconds
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return
    mapped, offset = _map, _offset
    assert mapped is not None
    sequence = _sequence + 1
    _SEQ.pack_into(mapped, offset, sequence)  # odd: being written
    now = _time()
    try:
        _FIELDS.pack_into(mapped, offset + 8, step, -1 if total is None else total, now)
    except struct.error:  # a float or another number type: as an int
        _FIELDS.pack_into(mapped, offset + 8, int(step), -1 if total is None else int(total), now)
    if _last_report is not None and step > _last_report[0]:
        # What a step takes, for the agent's count of the time a restart redoes.
        per_step = (now - _last_report[1]) / (step - _last_report[0])
        _step_seconds = 0.8 * _step_seconds + 0.2 * per_step if _step_seconds else per_step
        _F64.pack_into(mapped, offset + channel.STEP_SECONDS_OFFSET, _step_seconds)
    _last_report = (step, now)
    if desc is not None and desc != _desc_cache[0]:
        _desc_cache = (desc, channel.encode_desc(desc))
        mapped[offset + channel.DESC_OFFSET : offset + channel.DESC_END] = _desc_cache[1]
    _sequence = sequence + 1
    _SEQ.pack_into(mapped, offset, _sequence)
    if sequence == 1:  # this slot's first report: the agent starts sampling the steps
        _wake_agent()


def note_restore(began: float, ended: float, step: int) -> None:
    """``load_state`` ran from ``began`` to ``ended`` and restored ``step`` (-1: none): the
    agent's goodput ledger counts the worker's start and the restore apart."""
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return
    mapped = _map
    assert mapped is not None
    at = _offset + channel.RECOVERY_OFFSET
    channel.RESTORE.pack_into(mapped, at, began, 0.0, step)
    _F64.pack_into(mapped, at + 8, ended)  # last: the record is whole
    _wake_agent()


def note_saved() -> None:
    """``save_state`` committed a save: one more in this rank's count, and the agent woken
    (it counts them for ``--state-persist-every`` and waits for them when a failure is
    pending)."""
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return
    mapped = _map
    assert mapped is not None
    at = _offset + channel.SAVES_OFFSET
    _SEQ.pack_into(mapped, at, _SEQ.unpack_from(mapped, at)[0] + 1)
    _wake_agent(channel.SAVED)


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


def failure_pending() -> bool:
    """Whether another rank failed, hung or was lost and the agent is about to stop this
    worker: ``save_state`` now, and it is what the restarted world resumes from. Once a worker
    has asked (or given ``on_failure_pending`` a callback), its agent waits up to
    ``--jit-save-timeout`` seconds for its save before stopping it. Always False outside
    relaunch."""
    global _failure_listening
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return False
    mapped = _map
    assert mapped is not None
    if not _failure_listening:
        mapped[_offset + channel.FAILURE_LISTENING_OFFSET] = 1
        _failure_listening = True
    return mapped[channel.FAILURE_OFFSET] != 0


def on_failure_pending(callback: Callable[[], object]) -> None:
    """Call ``callback()`` in a thread of relaunch's when a failure is pending (see
    ``failure_pending``): for a worker that cannot look between steps, a save from another
    thread. Once per attempt; outside relaunch it does nothing."""
    if not failure_pending() and _state == _OPEN:
        path = channel.pending_path(os.environ[channel.CHANNEL_ENV], int(os.environ["LOCAL_RANK"]))
        try:
            fd = os.open(path, os.O_RDWR | _OPEN)  # never waits for a writer
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                return
            os.set_blocking(fd, True)
        except OSError:
            return
        import threading

        def wait_then_call() -> None:
            try:
                os.read(fd, 1)
            finally:
                os.close(fd)
            callback()

        threading.Thread(
            target=wait_then_call, name="relaunch-failure-pending", daemon=True
        ).start()
    elif _state == _OPEN:
        callback()  # already pending


# -- liveness: heartbeats and sections -------------------------------------------------------


class _Live:
    """This worker's liveness as it writes it into its slot."""

    beat_at = 0.0
    beat_due = 0.0
    beat_how = channel.BOUND_NONE
    beats = 0
    done = 0
    beat_gaps = Learner()
    durations: dict[str, Learner] = {}
    #: Open sections, innermost last: (name, entered, due, how the bound was set).
    open: list[tuple[str, float, float, int]] = []
    name_written = ""
    stacks_on_abort = False
    #: Each section name's time, as its entry in the slot holds it: name -> [entry, seconds,
    #: runs, the name as the entry stores it].
    times: dict[str, list[Any]] = {}


def _write_live() -> None:
    """Publish ``_Live`` into the slot under its seqlock; the caller holds ``_live_lock``."""
    global _live_sequence
    mapped = _map
    assert mapped is not None
    first = not _Live.stacks_on_abort
    if first:
        # The agent asks a hung worker (and every other rank) for its stack with SIGABRT.
        import faulthandler  # built in: costs nothing to import

        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
        _Live.stacks_on_abort = True
    offset = _offset + channel.LIVE_OFFSET
    name, entered, due, how = _Live.open[-1] if _Live.open else ("", 0.0, 0.0, 0)
    sequence = _live_sequence + 1
    _SEQ.pack_into(mapped, offset, sequence)
    _LIVE.pack_into(
        mapped,
        offset + 8,
        _Live.beat_at,
        _Live.beat_due,
        entered,
        due,
        _Live.done,
        _Live.beats,
        how,
        _Live.beat_how,
    )
    if name != _Live.name_written:
        mapped[_offset + channel.NAME_OFFSET : _offset + channel.NAME_END] = channel.encode_desc(
            name, channel.NAME
        )
        _Live.name_written = name
    _live_sequence = sequence + 1
    _SEQ.pack_into(mapped, offset, _live_sequence)
    if first:  # once the deadline is there to be read
        _wake_agent()


def _keep_learned() -> None:
    """Write what this worker learned where its agent keeps it for the job (this rank's
    learned bounds in the channel). Only when a bound is first learned or widens: rarely after
    the first steps. The caller holds ``_live_lock``."""
    from relaunch.core.sections import Learned, encode_learned

    def seen(learner: Learner) -> tuple[int, float]:
        return learner.count, learner.longest

    sections = {n: seen(k) for n, k in _Live.durations.items() if k.count >= LEARN_AFTER}
    beats = seen(_Live.beat_gaps) if _Live.beat_gaps.count >= LEARN_AFTER else None
    mapped = _map
    assert mapped is not None
    names = list(sections)
    while True:
        data = encode_learned(Learned({name: sections[name] for name in names}, beats))
        if channel.write_learned(mapped, _learned_at, data.encode()):
            return
        names = names[: len(names) // 2]  # too many long names to keep: the first ones


def _wake_agent(byte: bytes = b"1") -> None:
    """Wake the agent: with ``byte``, to read the saves' counts (``channel.SAVED``), or (any
    other) because the workers use the channel: their steps are to be sampled, their deadlines
    watched, from now on."""
    global _wake_fd
    if _wake_fd < 0:
        try:
            path = channel.wake_path(os.environ[channel.CHANNEL_ENV])
            _wake_fd = os.open(path, os.O_WRONLY | _OPEN)
        except (KeyError, OSError):
            return
    try:
        os.write(_wake_fd, byte)
    except OSError:
        pass  # full: the agent has been woken already


def heartbeat(timeout: float | None = None) -> None:
    """Tell the agent this worker is alive. The next heartbeat is due within ``timeout``
    seconds, or, when none is given, within a bound learned from the gaps between the earlier
    ones (``relaunch.core.sections``); a worker that misses it is hung, and the agent dumps the
    stacks of every rank and restarts the group."""
    if _state != _OPEN and (_state == _ABSENT or _open() is None):
        return
    now = _time()
    with _live_lock:
        if _Live.beat_at and _Live.beat_gaps.observe(now - _Live.beat_at):
            _keep_learned()
        bound, _Live.beat_how = _Live.beat_gaps.bound(timeout)
        _Live.beat_at, _Live.beat_due = now, (now + bound if bound else 0.0)
        _Live.beats += 1
        _write_live()


class section:  # lower case: used like a function, ``with relaunch.section("step"):``
    """``with relaunch.section("step"):`` marks a part of the loop that must end in time: within
    ``timeout`` seconds, or, when none is given, within a bound learned from the earlier runs of
    the section of that name (``relaunch.core.sections``). An overdue section is a hang: the
    agent dumps the stacks of every rank, names this rank and section, and restarts the group.
    Sections nest; the innermost open one is watched. Outside relaunch it does nothing."""

    __slots__ = ("_entered", "_name", "_timeout")

    def __init__(self, name: str, timeout: float | None = None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"a section's timeout must be a positive number, got {timeout!r}")
        self._name = name
        self._timeout = timeout
        self._entered = 0.0

    def __enter__(self) -> section:
        if _state != _OPEN and (_state == _ABSENT or _open() is None):
            return self
        now = self._entered = _time()
        with _live_lock:
            learner = _Live.durations.get(self._name)
            if learner is None:
                learner = _Live.durations[self._name] = Learner()
            bound, how = learner.bound(self._timeout)
            _Live.open.append((self._name, now, now + bound if bound else 0.0, how))
            _write_live()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._entered or _state != _OPEN:
            return
        now = _time()
        with _live_lock:
            if _Live.open and _Live.open[-1][1] == self._entered:
                _Live.open.pop()
            if kind is None:  # only a section that ended normally teaches its duration
                if _Live.durations[self._name].observe(now - self._entered):
                    _keep_learned()
                _Live.done += 1
                _add_time(self._name, now - self._entered)
            _write_live()


def _add_time(name: str, seconds: float) -> None:
    """Count ``seconds`` more in section ``name`` in its entry of the slot (the first
    ``channel.TIMES`` names get one): stragglers are judged on the time each rank spends in its
    sections. The caller holds ``_live_lock``."""
    kept = _Live.times.get(name)
    if kept is None:
        if len(_Live.times) >= channel.TIMES:
            return
        kept = [len(_Live.times), 0.0, 0, channel.encode_desc(name, channel.TIME_NAME)]
        _Live.times[name] = kept
    kept[1] += seconds
    kept[2] += 1
    mapped = _map
    assert mapped is not None
    at = _offset + channel.TIMES_OFFSET + kept[0] * channel.TIME_ENTRY
    (sequence,) = _SEQ.unpack_from(mapped, at)
    sequence += 1 + sequence % 2  # odd: being written
    _SEQ.pack_into(mapped, at, sequence)
    channel.TIME_FIELDS.pack_into(mapped, at + 8, kept[1], kept[2])
    # The name each time: the agent empties the slots between attempts (a rank restarted in
    # place keeps its process, and its counts).
    mapped[at + 24 : at + channel.TIME_ENTRY] = kept[3]
    _SEQ.pack_into(mapped, at, sequence + 1)
