"""A log file relaunch writes for a worker (``LogFile``): shared by the tee'd streams
(``procs.rank_streams``) and the duplicate filters' copies (``procs.duplicates``)."""

from __future__ import annotations

import os

from relaunch.procs.console_writer import write_all


class LogFile:
    """A log file relaunch writes for a worker; a write error is kept, never raised.

    On the first error (``ENOSPC``, ``EDQUOT``, ``EIO``...) the file is written no more (a file
    with a hole in the middle would mislead; one that stops is honest) and ``error`` says why;
    ``told`` is whether this is the first error of its kind in the process (the one to say).
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd: int | None = fd
        self.error = ""
        self.errno = 0

    def write(self, data: bytes) -> bool:
        """Append ``data``; False when this write failed (the first failure only)."""
        if self.fd is None:
            return True
        try:
            write_all(self.fd, data)
        except OSError as error:
            self._failed(error)
            return False
        return True

    def _failed(self, error: OSError) -> None:
        self.errno = error.errno or 0
        self.error = f"[Errno {error.errno}] {error.strerror or error}"
        self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.close(fd)
        except OSError as error:  # NFS reports a failed write back at close
            if not self.error:
                self.errno = error.errno or 0
                self.error = f"[Errno {error.errno}] {error.strerror or error}"
