"""The agent's side of the agent-worker channel (layout in ``core.channel``).

The channel file, its FIFOs and the parking lot's socket lie in one private directory
(``agent.shm``): no name of theirs can be taken or read by another user. Every path is opened
without following a symbolic link and without waiting.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterable

from relaunch.agent.shm import CHANNEL_PREFIX, PrivateDirectory
from relaunch.core import channel
from relaunch.core.sections import Learned, decode_learned, merge
from relaunch.core.workers.liveness import Liveness, read_liveness, read_section_times
from relaunch.core.workers.progress import Progress, read_progress
from relaunch.runtime import start_thread

#: How the agent opens a path of the channel's: never through a symbolic link, never waiting.
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

#: Told the saves committed since it was last told, by local rank (``saves_to``).
SavesListener = Callable[[dict[int, int]], None]


class Channel:
    """A shared-memory file for ``slots`` local ranks: their progress, liveness, saves and
    learned bounds, and the stop and failure flags."""

    def __init__(self, slots: int, on_first_use: Callable[[], None] = lambda: None) -> None:
        """``on_first_use`` is called (from a thread of the channel's) when a rank first reports
        progress, and when a worker first calls ``heartbeat`` or enters a ``section``: from then
        on its steps are worth sampling, its deadlines watching. Saves go to ``saves_to``'s
        listener."""
        self._directory = directory = PrivateDirectory(CHANNEL_PREFIX)
        try:
            self.path = os.path.join(directory.path, "channel")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
            try:
                os.ftruncate(fd, channel.size(slots))
                self._map = mmap.mmap(fd, channel.size(slots))
            finally:
                os.close(fd)
            self.slots = slots
            self._wake_path = channel.wake_path(self.path)
            os.mkfifo(self._wake_path, 0o600)
            # Read and write: opening does not wait for a writer, and reads block, not end,
            # between writers.
            self._wake_fd = os.open(self._wake_path, os.O_RDWR | _OPEN)
            os.set_blocking(self._wake_fd, True)
            self._pending_paths = [channel.pending_path(self.path, rank) for rank in range(slots)]
            for path in self._pending_paths:
                os.mkfifo(path, 0o600)
        except BaseException:
            directory.close()
            raise
        self._closing = False
        self._saves_lock = threading.Lock()
        self._saves_told = [0] * slots  # each slot's count of saves when last told
        self._on_saves: SavesListener | None = None
        self.reset()
        self._waker = start_thread(self._read_wakes, "relaunch-channel", on_first_use)

    def _read_wakes(self, on_first_use: Callable[[], None]) -> None:
        while True:
            data = os.read(self._wake_fd, 512)
            if not data or self._closing:
                return
            if channel.SAVED in data:
                self._tell_saves()
            if data.count(channel.SAVED) < len(data):
                on_first_use()

    def saves_to(self, listener: SavesListener | None) -> None:
        """Tell ``listener`` of the saves the workers commit (``save_state``), from the
        channel's thread."""
        with self._saves_lock:
            self._on_saves = listener

    def _tell_saves(self) -> None:
        with self._saves_lock:
            new = {}
            for rank in range(self.slots):
                at = channel.slot_offset(rank) + channel.SAVES_OFFSET
                count = channel.U64.unpack_from(self._map, at)[0]
                if count > self._saves_told[rank]:
                    new[rank] = count - self._saves_told[rank]
                    self._saves_told[rank] = count
            listener = self._on_saves
        if new and listener is not None:
            listener(new)

    def env(self) -> dict[str, str]:
        return {channel.CHANNEL_ENV: self.path}

    def reset(self) -> None:
        """Empty every slot and lower the stop flag, for a new group of workers (the bounds the
        workers learned stay: they are the job's)."""
        end = channel.learned_offsets(self.slots, 0)[0]
        with self._saves_lock:
            self._map[:end] = bytes(end)
            self._saves_told = [0] * self.slots
        channel.HEADER_STRUCT.pack_into(self._map, 0, channel.MAGIC, 0, self.slots)

    def request_stop(self) -> None:
        self._map[channel.STOP_OFFSET] = 1

    def announce_failure(self) -> None:
        """Raise the failure-pending flag and wake each rank's ``on_failure_pending`` callback
        (a rank with none has no reader: nothing is written for it)."""
        self._map[channel.FAILURE_OFFSET] = 1
        for path in self._pending_paths:
            try:
                fd = os.open(path, os.O_WRONLY | _OPEN)
            except OSError:  # ENXIO: no callback waits on it
                continue
            try:
                os.write(fd, b"!")
            except OSError:
                pass
            finally:
                os.close(fd)

    def failure_listeners(self, ranks: Iterable[int]) -> list[int]:
        """The ranks of ``ranks`` that will hear of a pending failure (``failure_pending()``)."""
        with memoryview(self._map) as view:
            return [rank for rank in ranks if channel.failure_listening(view, rank)]

    @property
    def stop_requested(self) -> bool:
        return self._map[channel.STOP_OFFSET] != 0

    def progress(self, rank: int) -> Progress | None:
        with memoryview(self._map) as view:
            return read_progress(view, rank)

    def liveness(self, rank: int) -> Liveness | None:
        """``rank``'s heartbeats and open section (None before it used either)."""
        with memoryview(self._map) as view:
            return read_liveness(view, rank)

    def section_times(self, rank: int) -> dict[str, tuple[float, int]]:
        """The seconds ``rank`` spent in each section name and its runs ended (``section``)."""
        with memoryview(self._map) as view:
            return read_section_times(view, rank)

    def restore(self, rank: int) -> tuple[float, float, int] | None:
        """When ``rank``'s ``load_state`` began and ended, and the step it restored (-1: none);
        None before it ended."""
        at = channel.slot_offset(rank) + channel.RECOVERY_OFFSET
        began, ended, step = channel.RESTORE.unpack_from(self._map, at)
        return None if not ended else (began, ended, step)

    def step_seconds(self, rank: int) -> float:
        """What a step of ``rank`` took lately (its reports' moving average; 0: unknown)."""
        at = channel.slot_offset(rank) + channel.STEP_SECONDS_OFFSET
        seconds: float = channel.F64.unpack_from(self._map, at)[0]
        return seconds

    def listening(self, rank: int) -> bool:
        """Whether ``rank`` reads the stop flag (it has called ``stop_requested()``)."""
        with memoryview(self._map) as view:
            return channel.listening(view, rank)

    def learned(self) -> Learned:
        """What the workers of this channel learned of their sections' and heartbeats' bounds
        (``relaunch.worker``), merged; a table that is not theirs counts for nothing."""
        learned = Learned()
        with memoryview(self._map) as view:
            for rank in range(self.slots):
                data = channel.read_learned(view, channel.learned_offsets(self.slots, rank))
                try:
                    learned = merge(learned, decode_learned(data)) if data else learned
                except ValueError:
                    pass
        return learned

    def close(self) -> None:
        self._closing = True
        os.write(self._wake_fd, b"\0")  # ends the reader
        self._waker.join()
        os.close(self._wake_fd)
        self._map.close()
        self._directory.close()
