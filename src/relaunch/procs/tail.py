"""``TailLog``: follow log files that other processes write, and echo their lines with a prefix."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from relaunch.core.output.lines import LineFramer
from relaunch.core.workers.call_forms import CallForm, choose
from relaunch.procs.console_writer import ConsoleWriter
from relaunch.runtime import start_thread

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16


#: ``TailLog``'s two forms, from its 4th parameter on: torch 2.13's and the seeds'.
TORCH_CALL = CallForm(
    "torch 2.13's",
    ("log_line_prefixes", "interval_sec", "log_line_filter"),
    frozenset({"progbar_events"}),
)
SEEDS_CALL = CallForm(
    "the seeds'",
    ("interval_sec", "progbar_events"),
    frozenset({"log_line_prefixes", "log_line_filter"}),
)


def _every_line(line: str) -> bool:
    return True


def kept_lines(lines: bytes, keep: Callable[[str], bool]) -> bytes:
    """The lines of ``lines`` (complete lines) that ``keep`` accepts, given each as text with
    its newline, as torch reads it (undecodable bytes replaced)."""
    return b"".join(
        line + b"\n"
        for line in lines.split(b"\n")[:-1]
        if keep(line.decode("utf-8", errors="replace") + "\n")
    )


class _FollowedFile:
    def __init__(self, path: str, prefix: bytes, keep: Callable[[str], bool] | None) -> None:
        self.path = path
        self.prefix = prefix
        self.keep = keep
        self.framer = LineFramer()
        self.file: int | None = None

    def _write(self, writer: ConsoleWriter, lines: bytes) -> None:
        shown = lines if self.keep is None else kept_lines(lines, self.keep)
        writer.write_lines(shown, self.prefix)

    def read_new(self, writer: ConsoleWriter) -> None:
        if self.file is None:
            try:
                self.file = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return
        while chunk := os.read(self.file, _READ_SIZE):
            self._write(writer, self.framer.feed(chunk))

    def finish(self, writer: ConsoleWriter) -> None:
        self._write(writer, self.framer.flush())
        if self.file is not None:
            os.close(self.file)
            self.file = None


def tail_logfile(
    header: str,
    file: str,
    dst: TextIO,
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """torch's: copy the lines of ``file`` to ``dst``, each prefixed ``header`` and kept only
    if ``log_line_filter(line)`` (None: every line), every ``interval_sec`` until ``finished``
    is set, then what is left; a file that never appears copies nothing. It blocks: ``TailLog``
    runs it for its files in a thread."""
    followed = _FollowedFile(file, header.encode(), log_line_filter)
    writer = ConsoleWriter(dst)
    while not finished.wait(interval_sec):
        followed.read_new(writer)
    followed.read_new(writer)
    followed.finish(writer)


class TailLog:
    """Tails ``log_files`` (``{index: path}``) to ``dst``: torch's ``TailLog``.

    Each line is prefixed ``[{name}{index}]:``, or ``log_line_prefixes[index]`` where given, and
    written only if ``log_line_filter(line)`` (the line as text, with its newline) is true.
    The files need not exist when ``start()`` is called: they are picked up once created. Files
    are read every ``interval_sec``; ``stop()`` reads what is left (a final partial line too) and
    returns promptly, whether or not the files ever appeared. With ``progbar_events``
    (ice-learn's), each batch of lines first asks a progress bar to clear itself.

    Two forms: torch 2.13's ``TailLog(name, log_files, dst, log_line_prefixes=None,
    interval_sec=0.1, log_line_filter=...)``, and the seeds' ``TailLog(name, log_files, dst,
    interval_sec=0.1, progbar_events=None)``, told apart by the 4th argument (a number: the
    seeds'). The launcher's own tee does not use this class: it reads workers' pipes as lines
    arrive. ``TailLog`` is for files written by processes it did not start.
    """

    def __init__(
        self,
        name: str,
        log_files: Mapping[int, str],
        dst: TextIO | None,
        *positional: Any,
        **keywords: Any,
    ) -> None:
        _, given = choose(
            "TailLog",
            TORCH_CALL,
            SEEDS_CALL,
            positional,
            keywords,
            lambda value: value is None or isinstance(value, Mapping),
            lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
            "its 4th argument",
        )
        prefixes: Mapping[int, str] = given.get("log_line_prefixes") or {}
        keep: Callable[[str], bool] = given.get("log_line_filter", _every_line)
        self._files = [
            _FollowedFile(
                path,
                prefixes.get(index, f"[{name}{index}]:").encode(),
                None if keep is _every_line else keep,
            )
            for index, path in log_files.items()
        ]
        self._writer = None if not dst else ConsoleWriter(dst, given.get("progbar_events"))
        self._interval: float = given.get("interval_sec", 0.1)
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> TailLog:
        if self._files and self._writer is not None and self._thread is None:
            self._thread = start_thread(self._run, "relaunch-taillog")
        return self

    def _run(self) -> None:
        writer = self._writer
        assert writer is not None
        try:
            while not self._finished.wait(self._interval):
                for followed in self._files:
                    followed.read_new(writer)
            for followed in self._files:
                followed.read_new(writer)
                followed.finish(writer)
        except Exception:  # an unreadable file, or the user's log_line_filter: said, as torch
            log.exception("error tailing log files")

    def stop(self) -> None:
        self._finished.set()
        if self._thread is not None:
            self._thread.join()
        self._stopped = True

    def stopped(self) -> bool:
        return self._stopped
