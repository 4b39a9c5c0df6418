"""Connections a server closed for misbehaving, logged without flooding: the built-in store's
and the state peers' (``agent.state_peers``)."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relaunch.server_loop import ServerLoop, Timer


class Refusals:
    """The first refusal of a quiet spell in full (who, and why), the others summed up by
    reason in one line per ``interval`` seconds (``tick`` at its end), to the server's
    ``log``; ``server`` names it in each line. Not thread-safe: a threaded server holds a lock
    around it."""

    def __init__(self, interval: float, server: str, log: logging.Logger) -> None:
        self._interval = interval
        self._server, self._log = server, log
        self.until: float | None = None  # the end of the current interval; None: quiet
        self._counts: dict[str, int] = {}
        self.total = 0  # every refusal since the start
        self._timer: Timer | None = None  # the current interval's end, on a server loop

    def timed(self, loop: ServerLoop, lock: threading.Lock | None = None) -> None:
        """Tick at each interval's end on ``loop`` (from its thread; ``lock``: held around
        each tick, for a server that notes from other threads)."""
        if self.until is None or self._timer is not None:
            return

        def tick() -> None:
            self._timer = None
            with lock or contextlib.nullcontext():
                self.tick(loop.clock.monotonic())
            self.timed(loop, lock)

        self._timer = loop.call_at(self.until, tick)

    def note(self, peer: str, reason: str, detail: str, now: float) -> None:
        self.total += 1
        if self.until is None:
            self._log.warning(
                "%s: closing %s: %s (more such are summed up every %gs)",
                self._server,
                peer,
                detail,
                self._interval,
            )
            self.until = now + self._interval
        else:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def tick(self, now: float) -> None:
        """At an interval's end: its summary line, if any were closed during it."""
        if self.until is not None and now >= self.until:
            self.until = now + self._interval if self._counts else None
            self.flush()

    def flush(self) -> None:
        if not self._counts:
            return
        counts, self._counts = self._counts, {}
        ranked = sorted(counts.items(), key=lambda item: -item[1])
        self._log.warning(
            "%s: closed %s more connections in the last %gs: %s",
            self._server,
            f"{sum(counts.values()):,}",
            self._interval,
            ", ".join(f"{n:,} {reason}" for reason, n in ranked),
        )
