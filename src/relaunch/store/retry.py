"""Retrying with backoff by a deadline: the one way a store client waits between attempts.

The built-in store's client reconnecting, etcd's gateway between laps over the members, and the
etcd feed opening its watch again each pause 10 ms after a failure, doubling up to 0.5 s, and
give up once the time left is shorter than the next pause.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from relaunch.runtime import SYSTEM_CLOCK, Clock

#: The first pause, and the longest one (each pause doubles the one before, up to it).
FIRST_PAUSE = 0.01
LONGEST_PAUSE = 0.5


class Backoff:
    """The pauses between the attempts of one operation that must end at ``until`` (a
    ``clock.monotonic()`` instant)."""

    def __init__(
        self,
        until: float,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._until, self._clock, self._sleep = until, clock, sleep
        self.delay = FIRST_PAUSE  # the next pause

    def pause(self) -> bool:
        """Sleep before the next attempt, and lengthen the pause after it; False, without
        sleeping, when the time left is shorter than the pause: the caller gives up."""
        if self._until - self._clock.monotonic() < self.delay:
            return False
        self._sleep(self.delay)
        self.delay = min(self.delay * 2, LONGEST_PAUSE)
        return True
