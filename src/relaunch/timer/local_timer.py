"""Timers over a multiprocessing queue: for workers that are children of the server's process."""

from __future__ import annotations

import logging
import os
import queue
import time
from typing import Any

from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.timer.base import (
    ReapHandler,
    RequestQueue,
    TableTimerServer,
    TimerClient,
    TimerRequest,
)

#: torch's names; the module's other names are relaunch's own.
__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]

log = logging.getLogger(__name__)

_WAKE = "relaunch-timer-wake"


class LocalTimerClient(TimerClient):
    """Sends this process's (pid-identified) timer requests to a ``LocalTimerServer``."""

    def __init__(self, mp_queue: Any) -> None:
        self._mp_queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, -1))


class MultiprocessingRequestQueue(RequestQueue):
    """A ``RequestQueue`` on a ``multiprocessing`` queue; blocking reads, no polling."""

    def __init__(self, mp_queue: Any) -> None:
        self._mp_queue = mp_queue

    def size(self) -> int:
        try:
            return int(self._mp_queue.qsize())
        except NotImplementedError:  # macOS has no qsize
            return 1

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Up to ``size`` requests, waiting at most ``timeout`` seconds for them (torch's
        meaning); ``interrupt`` ends the wait at once."""
        requests: list[TimerRequest] = []
        deadline = time.monotonic() + timeout
        while len(requests) < size:
            wait = deadline - time.monotonic()
            try:
                item = self._mp_queue.get(block=wait > 0, timeout=wait if wait > 0 else None)
            except queue.Empty:
                break
            if isinstance(item, TimerRequest):
                requests.append(item)
            elif isinstance(item, str) and item == _WAKE:
                break
            else:
                log.warning("timer server: ignored %r on its queue: not a TimerRequest", item)
        return requests

    def interrupt(self) -> None:
        self._mp_queue.put(_WAKE)


class LocalTimerServer(TableTimerServer):
    """Reaps (SIGKILL) the workers whose ``LocalTimerClient`` timers on ``mp_queue`` expire."""

    def __init__(
        self,
        mp_queue: Any,
        max_interval: float = 60,
        daemon: bool = True,
        *,
        on_reap: ReapHandler | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(
            MultiprocessingRequestQueue(mp_queue),
            max_interval,
            daemon,
            on_reap=on_reap,
            clock=clock,
        )
