"""torchft's lighthouse, started and kept alive by relaunch (the decisions are
``core.run.lighthouse``'s).

``Lighthouse(settings, log_path).start()`` runs ``lighthouse_program.py`` (torchft's own server,
loaded from its extension without torch) on a free port of ``host`` and returns the address the
workers get (``environment()``: ``TORCHFT_LIGHTHOUSE``). A thread waits on the process's pidfd:
a death (SIGKILL, a crash) is seen at once, said in one line, and the lighthouse is started
again on the same port (torchft's server sets ``SO_REUSEADDR``, so the port binds again at
once), after the backoff of ``core.run.lighthouse.RESTART_BACKOFF`` when it keeps dying. A
restarted one first sends a heartbeat for each group of the last quorum its log shows
(``core.run.lighthouse.last_participants``), so that its first quorum waits for them all.
Its output goes to ``log_path``. ``close()`` stops it and reaps it; if the launcher dies
however it dies, the end of the program's stdin ends it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

import relaunch.core.run.lighthouse as decide
from relaunch.core.durations import seconds
from relaunch.core.run.failures import describe_exit
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread

log = logging.getLogger(__name__)

#: The program each lighthouse runs, read and run by path.
PROGRAM = os.path.join(os.path.dirname(__file__), "lighthouse_program.py")
#: Seconds a lighthouse has to leave once its stdin ended, before it is killed.
STOP_TIMEOUT = 2.0


def torchft_importable() -> bool:
    """Whether ``import torchft`` would find it (found, not imported: torch stays out)."""
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        return False


def torchft_extension() -> str | None:
    """The path of torchft's extension module (``torchft/_torchft*.so``), which holds the
    lighthouse; None when torchft or its extension is not found."""
    try:
        spec = importlib.util.find_spec("torchft")
    except (ImportError, ValueError):
        return None
    for folder in (spec and spec.submodule_search_locations) or ():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_torchft" + suffix)
            if os.path.isfile(path):
                return path
    return None


def start_if_wanted(
    environ: Mapping[str, str],
    replica_groups: int | None,
    log_dir: str,
    min_replicas: int = decide.MIN_REPLICAS,
    host: str = "127.0.0.1",
    say: Callable[[str], None] = log.warning,
) -> Lighthouse | None:
    """The job's lighthouse, started, when it wants one (``decide.wants_lighthouse``: replica
    groups, torchft importable, ``TORCHFT_LIGHTHOUSE`` unset), logging to
    ``log_dir/lighthouse.log``; None otherwise. Raises ``LighthouseError`` when it cannot
    start."""
    if not decide.wants_lighthouse(environ, torchft_importable(), replica_groups):
        return None
    settings, wrong = decide.settings_from(environ, min_replicas)
    for line in wrong:
        say(line)
    lighthouse = Lighthouse(settings, os.path.join(log_dir, "lighthouse.log"), host, say)
    lighthouse.start()
    return lighthouse


class LighthouseError(Exception):
    """The lighthouse could not be started; the message says why and where its log is."""


class Lighthouse:
    """One job's lighthouse on ``host``: started once, restarted on the same port whenever it
    dies, until ``close``: on ``port``, or on a free one (0). ``say`` hears each line a person
    should read; ``extension`` is torchft's extension module (by default, the one found)."""

    def __init__(
        self,
        settings: decide.LighthouseSettings,
        log_path: str,
        host: str = "127.0.0.1",
        say: Callable[[str], None] = log.warning,
        clock: Clock = SYSTEM_CLOCK,
        extension: str | None = None,
        port: int = 0,
    ) -> None:
        self.settings, self.log_path, self.host = settings, log_path, host
        self._say, self._clock = say, clock
        self._extension = extension
        self._first_port = port
        self.port: int | None = None
        self.restarts = 0  # how many times it was started again
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._log_offset = 0
        self._deaths = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str | None:
        """``http://HOST:PORT``, what workers are given (None before ``start``)."""
        return None if self.port is None else decide.worker_address(self.host, self.port)

    @property
    def pid(self) -> int | None:
        """The running lighthouse's pid (None while none runs)."""
        proc = self._proc
        return None if proc is None or proc.returncode is not None else proc.pid

    def environment(self) -> dict[str, str]:
        """What every worker's environment gets: ``TORCHFT_LIGHTHOUSE``."""
        if self.address is None:
            raise RuntimeError("the lighthouse was not started")
        return {decide.ADDRESS_VAR: self.address}

    def start(self, timeout: float = decide.START_TIMEOUT) -> str:
        """Start it (on a free port unless one was given) and keep it alive; its address once
        it listens."""
        extension = self._extension or torchft_extension()
        if extension is None:
            raise LighthouseError(
                "torchft's extension module (torchft/_torchft) was not found: no lighthouse "
                f"started; set {decide.ADDRESS_VAR} to one of yours"
            )
        self._extension = extension
        how = self._spawn(self._first_port, timeout)  # port 0: it binds a free one
        if how is not None:
            raise LighthouseError(
                f"torchft's lighthouse did not start: it {how} (its log: {self.log_path})"
            )
        self._thread = start_thread(self._watch, "lighthouse")
        assert self.address is not None
        return self.address

    def close(self) -> None:
        """Stop it and reap it; no restart after this (a second call does nothing)."""
        if self._closing.is_set():
            return
        self._closing.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(decide.START_TIMEOUT + STOP_TIMEOUT)
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the keeper thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            proc = self._proc
            if proc is None:
                return
            pidfd = os.pidfd_open(proc.pid)
            try:
                readable, _, _ = select.select([pidfd, self._wake_r], [], [])
            finally:
                os.close(pidfd)
            if self._wake_r in readable:
                return
            proc.wait()
            _release(proc)
            if not self._restart(proc, describe_exit(proc.returncode or 0)):
                return

    def _restart(self, dead: subprocess.Popen[bytes], how: str) -> bool:
        """Start it again after ``dead`` died ``how``, until one listens (True) or ``close``
        came first (False)."""
        died_at = self._clock.monotonic()
        groups = decide.last_participants(self._log_tail())
        while True:
            self._deaths = decide.in_a_row(self._deaths, died_at - self._started_at)
            delay = decide.restart_delay(self._deaths)
            address = self.address or ""
            self._say(decide.death_line(dead.pid, how, address, delay, self._deaths))
            if self._deaths >= decide.SHOW_LOG_AFTER:
                self._say(f"its log ({self.log_path}) begins: {self._log_head()}")
            if self._closing.wait(delay):
                return False
            assert self.port is not None
            failed = self._spawn(self.port, decide.START_TIMEOUT, groups)
            if failed is None:
                self.restarts += 1
                back = self._clock.monotonic() - died_at
                self._say(f"torchft's lighthouse is back on {address} after {seconds(back)}")
                return True
            if self._closing.is_set():
                return False
            how, died_at = failed, self._clock.monotonic()
            dead = self._proc or dead

    # -- one process ---------------------------------------------------------------------------

    def _spawn(self, port: int, timeout: float, heartbeats: list[str] | None = None) -> str | None:
        """Start one lighthouse on ``port`` and wait until it says it listens (having sent a
        heartbeat for each replica id of ``heartbeats``): None when it does, else how it failed
        (it is reaped then)."""
        assert self._extension is not None
        bind = decide.bind_address(self.host, port)
        argv = decide.command(
            sys.executable, PROGRAM, self._extension, bind, self.settings, heartbeats or ()
        )
        with open(self.log_path, "ab") as log_file:
            self._log_offset = log_file.tell()
            with self._lock:
                if self._closing.is_set():
                    return "was closed"
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log_file,
                    start_new_session=True,  # a terminal's ^C is for relaunch, not for it
                )
                self._proc = proc
        self._started_at = self._clock.monotonic()
        assert proc.stdout is not None
        line = _read_line(proc.stdout.fileno(), self._wake_r, timeout)
        listening = decide.port_from(line.decode(errors="replace")) if line else None
        if listening is not None:
            self.port = listening
            return None
        if self._closing.is_set():
            return "was closed"
        if line is None:
            _stop(proc)
            return f"did not listen within {seconds(timeout)}"
        code = proc.wait()
        _release(proc)
        return f"{describe_exit(code)} before it listened"

    def _log_tail(self) -> str:
        """The end of its log (``decide.LOG_TAIL_BYTES`` at most); empty when unreadable."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(max(0, os.fstat(log_file.fileno()).st_size - decide.LOG_TAIL_BYTES))
                return log_file.read(decide.LOG_TAIL_BYTES).decode(errors="replace")
        except OSError:
            return ""

    def _log_head(self) -> str:
        """The first lines its last start wrote to its log, joined by `` | ``."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self._log_offset)
                text = log_file.read(8192).decode(errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc.strerror or exc})"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return " | ".join(lines[: decide.LOG_LINES]) or "(empty)"


def _read_line(fd: int, wake: int, timeout: float) -> bytes | None:
    """One line from ``fd`` within ``timeout`` seconds: the line (b"" at the end of the stream,
    as when the process died first), or None when the time ran out or ``wake`` was written."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        readable, _, _ = select.select([fd, wake], [], [], left)
        if wake in readable:
            return None
        if fd in readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            data += chunk
    return data.split(b"\n", 1)[0]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc``: its stdin closed (it shuts its server down and leaves), SIGKILL after
    ``STOP_TIMEOUT``; reaped, its pipes closed."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _release(proc)


def _release(proc: subprocess.Popen[bytes]) -> None:
    """Close the pipes of ``proc``, which ended."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
