"""Who still uses a store: its open connections, and whether any of them asked something
lately. A store that outlives its host's own run (replica groups on several nodes: the host's
group ended, another group's agents still use the store) ends once they have left.

The server's thread notes each request and each connection's end; another thread waits on a
condition, woken by each end and by its own deadline, never polling.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from relaunch.runtime import SYSTEM_CLOCK, Clock


class Attendance:
    """A server's connections (``connected()``, read from any thread) and the requests it took
    (``requests``, counted by the server's thread)."""

    def __init__(self, connected: Callable[[], int], clock: Clock = SYSTEM_CLOCK) -> None:
        self._changed = threading.Condition()
        self._connected, self._clock = connected, clock
        self.requests = 0

    def connected(self) -> int:
        """The connections the server holds now."""
        return self._connected()

    def left(self) -> None:
        """A connection ended."""
        with self._changed:
            self._changed.notify_all()

    def wait_gone(self, silence: float) -> bool:
        """Wait until no connection is left (True), or until none of them asked anything for
        ``silence`` seconds (False: what is left are peers that never say goodbye, a node gone
        or cut off). Silence is seen between ``silence`` and twice that after the last
        request."""
        with self._changed:
            heard, since = self.requests, self._clock.monotonic()
            while self._connected():
                now = self._clock.monotonic()
                if self.requests != heard:
                    heard, since = self.requests, now
                elif now - since >= silence:
                    return False
                self._changed.wait(since + silence - now)
            return True
