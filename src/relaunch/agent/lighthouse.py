"""torchft's lighthouse, started and kept alive by relaunch (the decisions are
``core.run.lighthouse``'s).

``Lighthouse(settings, log_path).start()`` runs ``lighthouse_program.py`` (torchft's own server,
loaded from its extension without torch) on a free port of ``host`` and returns the address the
workers get (``environment()``: ``TORCHFT_LIGHTHOUSE``): its ``front``'s, a loopback relay, when
it has one (one node), else its own. A thread waits on the process's pidfd: a death (SIGKILL, a
crash) is seen at once, said in one line, and the lighthouse is started again, after the
backoff of ``core.run.lighthouse.RESTART_BACKOFF`` when it keeps dying, on a new free port that
nobody reaches until its quorum ids are past the last one its log shows
(``core.run.lighthouse.last_quorum``; torchft names each quorum's store prefix by its id, and a
restarted lighthouse counts from 1). Then the front forwards to it, or ``on_move`` says where it
is (several nodes: the store's key, which every node's relay follows). Its output goes to
``log_path``. ``close()`` stops it and reaps it; if the launcher dies however it dies, the end of
the program's stdin ends it.
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
from relaunch.agent.lighthouse_relay import LighthouseRelay
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
    """The job's lighthouse on one node, started behind a loopback relay (the workers' address
    outlives a restart, which moves it to a new port), when it wants one
    (``decide.wants_lighthouse``: replica groups, torchft importable, ``TORCHFT_LIGHTHOUSE``
    unset), logging to ``log_dir/lighthouse.log``; None otherwise. Raises ``LighthouseError``
    when it cannot start."""
    if not decide.wants_lighthouse(environ, torchft_importable(), replica_groups):
        return None
    settings, wrong = decide.settings_from(environ, min_replicas)
    for line in wrong:
        say(line)
    log_path = os.path.join(log_dir, "lighthouse.log")
    lighthouse = Lighthouse(settings, log_path, host, say, front=LighthouseRelay())
    lighthouse.start()
    return lighthouse


class LighthouseError(Exception):
    """The lighthouse could not be started; the message says why and where its log is."""


class Lighthouse:
    """One job's lighthouse on ``host``: started once, on ``port`` or a free one (0), and
    restarted on a new free port whenever it dies, until ``close``. The workers reach it
    through ``front`` (a relay, started and closed with it, that forwards to wherever it is
    now), or at its own address, and then ``on_move`` hears where a restarted one listens: None
    as it dies, its port once its quorum ids are past its predecessor's. ``say`` hears each
    line a person should read; ``extension`` is torchft's extension module (by default, the one
    found)."""

    def __init__(
        self,
        settings: decide.LighthouseSettings,
        log_path: str,
        host: str = "127.0.0.1",
        say: Callable[[str], None] = log.warning,
        clock: Clock = SYSTEM_CLOCK,
        extension: str | None = None,
        port: int = 0,
        front: LighthouseRelay | None = None,
        on_move: Callable[[int | None], None] | None = None,
    ) -> None:
        self.settings, self.log_path, self.host = settings, log_path, host
        self.front, self._on_move = front, on_move
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
        """``http://HOST:PORT``, what workers are given: its front's, or its own (None before
        ``start``)."""
        if self.port is None:
            return None
        if self.front is not None:
            return self.front.address
        return decide.worker_address(self.host, self.port)

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
        if self.front is not None:
            try:
                self.front.start()
            except OSError:
                self.close()
                raise
            self._moved(self.port)
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
        if self.front is not None and self.front.port is not None:
            self.front.close()
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
        self._moved(None)
        past, groups = decide.last_quorum(self._log_tail())
        while True:
            self._deaths = decide.in_a_row(self._deaths, died_at - self._started_at)
            delay = decide.restart_delay(self._deaths)
            self._say(decide.death_line(dead.pid, how, delay, self._deaths))
            if self._deaths >= decide.SHOW_LOG_AFTER:
                self._say(f"its log ({self.log_path}) begins: {self._log_head()}")
            if self._closing.wait(delay):
                return False
            # A new port: nobody reaches it before its quorum ids are past ``past``.
            failed = self._spawn(0, decide.START_TIMEOUT, groups, past)
            if failed is None:
                self._moved(self.port)
                self.restarts += 1
                back = self._clock.monotonic() - died_at
                self._say(decide.back_line(self.address or "", back, past))
                return True
            if self._closing.is_set():
                return False
            how, died_at = failed, self._clock.monotonic()
            dead = self._proc or dead

    # -- one process ---------------------------------------------------------------------------

    def _moved(self, port: int | None) -> None:
        """Where it listens now (None: nowhere), for its front or ``on_move``."""
        if self.front is not None:
            self.front.set_target(None if port is None else (self.host, port))
        if self._on_move is not None:
            self._on_move(port)

    def _spawn(
        self, port: int, timeout: float, heartbeats: list[str] | None = None, past: int = 0
    ) -> str | None:
        """Start one lighthouse on ``port`` and wait until it says it listens (its quorum ids
        driven past ``past`` by the replica ids of ``heartbeats``): None when it does, else how
        it failed (it is reaped then)."""
        assert self._extension is not None
        bind = decide.bind_address(self.host, port)
        argv = decide.command(
            sys.executable, PROGRAM, self._extension, bind, self.settings, heartbeats or (), past
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
