"""The agent's side of the agent-worker channel (layout in ``core.channel``)."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable

from relaunch.core import channel
from relaunch.core.liveness import Liveness, read_liveness
from relaunch.core.progress import Progress, read_progress
from relaunch.procs.guardian import guardian
from relaunch.runtime import start_thread


class Channel:
    """A shared-memory file for ``slots`` local ranks: their progress and liveness, and the stop
    flag."""

    def __init__(self, slots: int, on_first_use: Callable[[], None] = lambda: None) -> None:
        """``on_first_use`` is called (from a thread of the channel's) when a rank first reports
        progress, and when a worker first calls ``heartbeat`` or enters a ``section``: from then
        on its steps are worth sampling, its deadlines watching."""
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="relaunch_channel_", dir=directory)
        try:
            os.ftruncate(fd, channel.size(slots))
            self._map = mmap.mmap(fd, channel.size(slots))
        finally:
            os.close(fd)
        self.slots = slots
        guardian().register_file(self.path)  # removed even if this process is SIGKILLed
        self._wake_path = channel.wake_path(self.path)
        os.mkfifo(self._wake_path, 0o600)
        guardian().register_file(self._wake_path)
        # Read and write: opening does not wait for a writer, and reads block, not end, between
        # writers.
        self._wake_fd = os.open(self._wake_path, os.O_RDWR)
        self._closing = False
        self._waker = start_thread(self._read_wakes, "relaunch-channel", on_first_use)
        self.reset()

    def _read_wakes(self, on_first_use: Callable[[], None]) -> None:
        while os.read(self._wake_fd, 512) and not self._closing:
            on_first_use()

    def env(self) -> dict[str, str]:
        return {channel.CHANNEL_ENV: self.path}

    def reset(self) -> None:
        """Empty every slot and lower the stop flag, for a new group of workers."""
        self._map[:] = bytes(len(self._map))
        channel.HEADER_STRUCT.pack_into(self._map, 0, channel.MAGIC, 0, self.slots)

    def request_stop(self) -> None:
        self._map[channel.STOP_OFFSET] = 1

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

    def listening(self, rank: int) -> bool:
        """Whether ``rank`` reads the stop flag (it has called ``stop_requested()``)."""
        with memoryview(self._map) as view:
            return channel.listening(view, rank)

    def close(self) -> None:
        self._closing = True
        os.write(self._wake_fd, b"\0")  # ends the reader
        self._waker.join()
        os.close(self._wake_fd)
        self._map.close()
        for path in (self.path, self._wake_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            guardian().unregister_file(path)
