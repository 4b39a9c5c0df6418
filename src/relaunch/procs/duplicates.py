"""torch's duplicate filters: the tee'd lines of every rank that contain any of some strings,
each with its rank's prefix, copied to one file (``filtered_stdout.log``, ``filtered_stderr.log``).

The tee'd streams hand their lines over as they show them (``procs.rank_streams``); the file
is closed when the last of them ends. A write error is said once and stops the copy, never the
workers (``LogFile``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from relaunch.procs.log_file import LogFile

log = logging.getLogger(__name__)


def matching_lines(lines: bytes, prefix: bytes, needles: Sequence[str]) -> bytes:
    """The lines of ``lines`` (complete lines) that contain any of ``needles``, prefixed."""
    whole = lines.decode("utf-8", errors="replace")
    if not any(needle in whole for needle in needles):
        return b""  # most chunks: no line to look at one by one
    return b"".join(
        prefix + line + b"\n"
        for line in lines.split(b"\n")[:-1]
        if any(needle in line.decode("utf-8", errors="replace") for needle in needles)
    )


class FilteredCopy:
    """The file at ``path`` that gets the tee'd lines containing any of ``needles``.

    It is held by its maker and by each stream that feeds it (``hold``); each ``release``s it
    once done, and the last one closes the file.
    """

    def __init__(self, path: str, needles: Sequence[str]) -> None:
        self.path = path
        self.needles = tuple(needles)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._file = LogFile(path, fd)
        self._holders = 1
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def take(self, prefix: bytes, lines: bytes) -> None:
        """Copy the lines of ``lines`` that match, each prefixed with ``prefix``."""
        kept = matching_lines(lines, prefix, self.needles)
        if not kept:
            return
        with self._lock:
            if not self._file.write(kept):
                log.warning("cannot write %s: %s; it stops here", self.path, self._file.error)

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                self._file.close()
