"""The agent's side of the agent-worker channel (layout in ``core.channel``)."""

from __future__ import annotations

import mmap
import os
import tempfile

from relaunch.core import channel
from relaunch.core.progress import Progress, read_progress
from relaunch.procs.guardian import guardian


class Channel:
    """A shared-memory file for ``slots`` local ranks: their progress, and the stop flag."""

    def __init__(self, slots: int) -> None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="relaunch_channel_", dir=directory)
        try:
            os.ftruncate(fd, channel.size(slots))
            self._map = mmap.mmap(fd, channel.size(slots))
        finally:
            os.close(fd)
        self.slots = slots
        guardian().register_file(self.path)  # removed even if this process is SIGKILLed
        self.reset()

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

    def listening(self, rank: int) -> bool:
        """Whether ``rank`` reads the stop flag (it has called ``stop_requested()``)."""
        with memoryview(self._map) as view:
            return channel.listening(view, rank)

    def close(self) -> None:
        self._map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        guardian().unregister_file(self.path)
