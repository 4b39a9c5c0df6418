"""Writing workers' lines to the launcher's console: whole lines, bytes as they came."""

from __future__ import annotations

import threading
from typing import TextIO

from relaunch.core.lines import prefix_lines

#: How long a writer waits for a progress bar to clear itself before writing anyway.
PROGBAR_CLEAR_TIMEOUT = 0.5

ProgbarEvents = dict[str, threading.Event]

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(dst: TextIO) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(id(dst), threading.Lock())


class ConsoleWriter:
    """Writes prefixed complete lines to ``dst`` in one piece, so ranks never interleave mid-line.

    Bytes go to ``dst.buffer`` when there is one (undecodable bytes pass through untouched), else
    they are decoded with replacement characters. With ``progbar_events`` (ice-learn's handshake),
    each batch of lines first asks the progress bar to clear itself (``trigger_clear``), waits a
    bounded time for ``cleared``, writes every line as ``\\r{line}\\033[K\\n``, then lets the bar
    redraw by clearing ``trigger_clear``.
    """

    def __init__(self, dst: TextIO, progbar_events: ProgbarEvents | None = None) -> None:
        self._dst = dst
        self._binary = getattr(dst, "buffer", None)
        self._progbar = progbar_events
        self._lock = _lock_for(dst)

    def render(self, lines: bytes, prefix: bytes) -> bytes:
        """Complete lines (each ending in ``\\n``) as they will appear: each one prefixed."""
        return prefix_lines(lines, prefix, progress_safe=self._progbar is not None)

    def write(self, rendered: bytes) -> None:
        """Write what ``render`` made, in one piece, after the progress bar (if any) cleared."""
        if not rendered:
            return
        if self._progbar is None:
            self._write(rendered)
            return
        trigger, cleared = self._progbar["trigger_clear"], self._progbar["cleared"]
        trigger.set()
        try:
            cleared.wait(PROGBAR_CLEAR_TIMEOUT)
            self._write(rendered)
        finally:
            trigger.clear()

    def write_lines(self, lines: bytes, prefix: bytes) -> None:
        self.write(self.render(lines, prefix))

    def _write(self, data: bytes) -> None:
        with self._lock:
            try:
                if self._binary is not None:
                    self._dst.flush()
                    self._binary.write(data)
                    self._binary.flush()
                else:
                    self._dst.write(data.decode("utf-8", errors="replace"))
                    self._dst.flush()
            except (OSError, ValueError):
                # A closed or broken console must not stop the log files from being written.
                pass
