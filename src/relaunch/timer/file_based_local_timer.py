"""Timers over a named pipe (FIFO): any process on the host that can open the file may send.

Each request is one JSON line, written with one ``write`` of at most ``PIPE_BUF`` bytes, so
requests from many processes never interleave::

    {"version": 1, "pid": 1234, "scope_id": "step", "expiration_time": 1.7e9, "signal": 9}

A negative ``expiration_time`` releases the scope. The server reads the pipe with a blocking
``poll`` (no busy loop), ignores (and logs) anything malformed, and never crashes on input.
This module is the protocol, the client and the server; the pipe itself (which FIFO may be
trusted, reading its lines) is ``relaunch.timer.fifo``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal as signals
import time
from collections.abc import Callable, Collection
from typing import Any

from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.timer.base import ReapHandler, TableTimerServer, TimerClient, TimerRequest
from relaunch.timer.debug_info_logging import log_debug_info_for_expired_timers
from relaunch.timer.fifo import FifoRequestQueue, check_fifo
from relaunch.timer.fifo import check_server_fifo as check_server_fifo

#: torch's names; the module's other names are relaunch's own.
__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer"]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: The largest request one ``write`` delivers whole (POSIX guarantees at least 512; Linux 4096).
MAX_REQUEST = 4096


class FileTimerRequest(TimerRequest):
    """A timer request for the file server: the worker's pid, the signal it is reaped with,
    and when the worker made it (``acquired_at``, 0 if unknown), so that a report says how long
    the worker gave itself however late the request was read."""

    __slots__ = ("acquired_at", "signal", "version")

    def __init__(
        self,
        worker_pid: int,
        scope_id: str,
        expiration_time: float,
        signal: int = 0,
        acquired_at: float = 0.0,
    ) -> None:
        super().__init__(worker_pid, scope_id, expiration_time)
        self.version = PROTOCOL_VERSION
        self.signal = signal
        self.acquired_at = acquired_at

    @property
    def worker_pid(self) -> int:
        return int(self.worker_id)

    def to_json(self) -> str:
        data = {
            "version": self.version,
            "pid": self.worker_pid,
            "scope_id": self.scope_id,
            "expiration_time": self.expiration_time,
            "signal": self.signal,
        }
        if self.acquired_at:  # relaunch's addition; torch's server ignores it
            data["acquired_at"] = self.acquired_at
        return json.dumps(data)


def _number(data: dict[str, Any], key: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} {value!r} is not a number")
    return float(value)


def parse_request(line: bytes) -> FileTimerRequest:
    """One line from the pipe as a request; ValueError saying what is wrong with it."""
    try:
        data = json.loads(line)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    pid, scope, sig = data.get("pid"), data.get("scope_id"), data.get("signal", 0)
    if data.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {data.get('version')!r}, expected {PROTOCOL_VERSION}")
    if type(pid) is not int or pid <= 0:
        raise ValueError(f"pid {pid!r} is not a positive integer")
    if not isinstance(scope, str):
        raise ValueError(f"scope_id {scope!r} is not a string")
    expiration = _number(data, "expiration_time")
    if type(sig) is not int or not 0 <= sig < signals.NSIG:
        raise ValueError(f"signal {sig!r} is not a signal number")
    return FileTimerRequest(pid, scope, expiration, sig, _number(data, "acquired_at", 0.0))


def _parent_pid(pid: int) -> int:
    """The parent of ``pid`` (/proc), 0 when it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            data = stat_file.read()
    except OSError:
        return 0
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return 0


def is_descendant(pid: int) -> bool:
    """Whether ``pid`` is a descendant of this process (a child, a child's child, ...): the pids
    a ``FileTimerServer`` may reap unless its ``may_reap`` says otherwise. False where /proc
    cannot tell."""
    me = os.getpid()
    seen = 0
    while pid > 1 and seen < 4096:  # a bounded walk: a pid's ancestry is finite
        pid = _parent_pid(pid)
        if pid == me:
            return True
        seen += 1
    return False


class RequestTooLarge(ValueError, RuntimeError):
    """A timer request that one write cannot carry whole (a RuntimeError, as torch raises)."""


class FileTimerClient(TimerClient):
    """Sends this process's timer requests to the ``FileTimerServer`` reading ``file_path``.

    ``signal`` is what the worker is reaped with (SIGKILL); zero or negative only reports.
    With no server reading the FIFO (or no FIFO), ``acquire`` and ``release`` raise
    BrokenPipeError, as torch's do; a path that is no FIFO is a ValueError.
    """

    def __init__(self, file_path: str, signal: int = signals.SIGKILL) -> None:
        self._file_path = file_path
        self.signal = int(signal)
        self._fd: int | None = None
        self._fd_pid = 0

    def _no_server(self, why: str) -> BrokenPipeError:
        return BrokenPipeError(
            f"no timer server reads {self._file_path} ({why}): start a FileTimerServer on it "
            "first, or run under `relaunch --timers`"
        )

    def _pipe(self) -> int:
        if self._fd is not None and self._fd_pid == os.getpid():
            return self._fd
        try:
            check_fifo(self._file_path)
        except FileNotFoundError:
            raise self._no_server("it does not exist") from None
        try:
            # Non-blocking open fails at once when nobody reads, rather than hanging.
            fd = os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise self._no_server(exc.strerror or str(exc)) from None
        os.set_blocking(fd, True)
        self._fd, self._fd_pid = fd, os.getpid()
        return fd

    def _send(self, request: FileTimerRequest) -> None:
        data = (request.to_json() + "\n").encode()
        if len(data) > MAX_REQUEST:
            raise RequestTooLarge(
                f"timer scope {request.scope_id[:40]!r}... is too long: a request "
                f"must fit in {MAX_REQUEST} bytes"
            )
        pipe = self._pipe()
        try:
            os.write(pipe, data)
        except BrokenPipeError:
            self._fd = None
            raise self._no_server("the server that read it is gone") from None

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._send(
            FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal, time.time())
        )

    def release(self, scope_id: str) -> None:
        self._send(FileTimerRequest(os.getpid(), scope_id, -1, self.signal))


class FileTimerServer(TableTimerServer):
    """Reaps the workers whose ``FileTimerClient`` timers on the FIFO ``file_path`` expire.

    ``start()`` creates the FIFO (mode 0600) unless one is there, and refuses one that is a
    symbolic link, belongs to another user or is writable by others (ValueError); ``stop()``
    removes what it created. ``log_event(name, request)`` hears of each request and expiry as
    it happens. Whoever can write to the FIFO names pids, so a server reaps only the pids
    ``may_reap(pid)`` accepts: by default (``may_reap=None``) the descendants of this process
    (``is_descendant``); the agent passes its workers' process groups. A server never signals
    its own process. ``on_reap`` and ``hand_over``: as ``TableTimerServer``'s.
    """

    def __init__(
        self,
        file_path: str,
        run_id: str,
        max_interval: float = 10,
        daemon: bool = True,
        log_event: Callable[[str, FileTimerRequest | None], None] | None = None,
        *,
        on_reap: ReapHandler | None = None,
        hand_over: ReapHandler | None = None,
        may_reap: Callable[[int], bool] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._fifo_queue = FifoRequestQueue(parse_request, self._malformed)
        super().__init__(
            self._fifo_queue,
            max_interval,
            daemon,
            on_reap=on_reap,
            hand_over=hand_over,
            clock=clock,
        )
        self._file_path = file_path
        self._run_id = run_id
        self._log_event = log_event
        self._may_reap_pid = may_reap
        self._created = False

    @property
    def file_path(self) -> str:
        return self._file_path

    def _malformed(self, line: bytes, reason: str) -> None:
        log.warning("timer server: ignored a malformed request (%s): %r", reason, line[:200])
        if self._log_event is not None:
            self._log_event("malformed_request", None)

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        if self._log_event is not None:
            for request in timer_requests:
                event = "release" if request.expiration_time < 0 else "acquire"
                self._log_event(event, request if isinstance(request, FileTimerRequest) else None)
        super().register_timers(timer_requests)

    def clear_timers(self, worker_pids: set[Any]) -> None:
        """Drop every timer of ``worker_pids`` (torch's name for them)."""
        super().clear_timers(worker_pids)

    @staticmethod
    def is_process_running(pid: int) -> bool:
        """Whether a process ``pid`` exists that this process may signal."""
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True

    def _may_reap(self, pid: int) -> bool:
        if self._may_reap_pid is None:
            return is_descendant(pid)
        return self._may_reap_pid(pid)

    def _reap_worker(self, worker_id: Any) -> bool:
        with self._lock:
            scopes = [timer.scope for timer in self._expired.get(worker_id, [])]
        log_debug_info_for_expired_timers(self._run_id, {int(worker_id): scopes})
        if self._log_event is not None:
            for scope in scopes:
                self._log_event("timer_expired", FileTimerRequest(int(worker_id), scope, -1))
        return super()._reap_worker(worker_id)

    def start(self) -> None:
        """Create (or reuse) the FIFO and start the reaper thread."""
        try:
            os.mkfifo(self._file_path, 0o600)
            self._created = True
        except FileExistsError:
            check_server_fifo(self._file_path)
        self._fifo_queue.open(self._file_path)
        super().start()

    def stop(self) -> None:
        """Stop the reaper at once, close the FIFO, and remove it if this server made it."""
        super().stop()
        self._fifo_queue.close()
        if self._created:
            try:
                os.unlink(self._file_path)
            except FileNotFoundError:
                pass
            self._created = False


def descendant_of(roots: Callable[[], Collection[int]]) -> Callable[[int], bool]:
    """A ``may_reap`` accepting the pids in the process groups ``roots()`` lead."""

    def accept(pid: int) -> bool:
        try:
            return os.getpgid(pid) in roots()
        except OSError:
            return False

    return accept
