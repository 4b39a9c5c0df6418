"""``TailLog``: follow log files that other processes write, and echo their lines with a prefix."""

from __future__ import annotations

import logging
import os
import threading
from typing import TextIO

from relaunch.core.lines import LineFramer
from relaunch.procs.console_writer import ConsoleWriter, ProgbarEvents
from relaunch.runtime import start_thread

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16


class _FollowedFile:
    def __init__(self, path: str, prefix: bytes) -> None:
        self.path = path
        self.prefix = prefix
        self.framer = LineFramer()
        self.file: int | None = None

    def read_new(self, writer: ConsoleWriter) -> None:
        if self.file is None:
            try:
                self.file = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return
        while chunk := os.read(self.file, _READ_SIZE):
            writer.write_lines(self.framer.feed(chunk), self.prefix)

    def finish(self, writer: ConsoleWriter) -> None:
        writer.write_lines(self.framer.flush(), self.prefix)
        if self.file is not None:
            os.close(self.file)
            self.file = None


class TailLog:
    """Tails ``log_files`` (``{index: path}``) to ``dst``, prefixing each line ``[{name}{index}]:``.

    The files need not exist when ``start()`` is called: they are picked up once created. Files
    are read every ``interval_sec``; ``stop()`` reads what is left (a final partial line too) and
    returns promptly, whether or not the files ever appeared. The launcher's own tee does not use
    this class: it reads workers' pipes as lines arrive. ``TailLog`` is for files written by
    processes it did not start.
    """

    def __init__(
        self,
        name: str,
        log_files: dict[int, str],
        dst: TextIO,
        interval_sec: float = 0.1,
        progbar_events: ProgbarEvents | None = None,
    ) -> None:
        self._files = [
            _FollowedFile(path, f"[{name}{index}]:".encode()) for index, path in log_files.items()
        ]
        self._writer = ConsoleWriter(dst, progbar_events)
        self._interval = interval_sec
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> TailLog:
        if self._files and self._thread is None:
            self._thread = start_thread(self._run, "relaunch-taillog")
        return self

    def _run(self) -> None:
        try:
            while not self._finished.wait(self._interval):
                for followed in self._files:
                    followed.read_new(self._writer)
            for followed in self._files:
                followed.read_new(self._writer)
                followed.finish(self._writer)
        except OSError:
            log.exception("error tailing log files")

    def stop(self) -> None:
        self._finished.set()
        if self._thread is not None:
            self._thread.join()
        self._stopped = True

    def stopped(self) -> bool:
        return self._stopped
