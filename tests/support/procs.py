"""Processes of tests and benchmarks: liveness, killing by pid, and the one leak detector.

A run marks everything it starts with ``RELAUNCH_TEST_MARK=<mark>`` in the environment;
``collect_leaks`` finds what still carries the mark (and, for a child subreaper, its adopted
orphans), waits a grace period, kills the rest by pid and describes it. Used by
tests/conftest.py (the ``leaks`` fixture), tests/chaos/harness.py and benchmarks/harness.py.
Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Collection, Iterable

MARK_VAR = "RELAUNCH_TEST_MARK"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def pid_alive(pid: int, reap: bool = False) -> bool:
    """True while ``pid`` exists and is not a zombie; with ``reap``, reaps it when it is our
    zombie (never for a child a ``subprocess.Popen`` still has to wait for)."""
    stat = proc_stat(pid)
    if stat is None:
        return False
    if stat[0] in "ZX":
        if reap and stat[1] == os.getpid():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        return False
    return True


def cmdline(pid: int) -> str:
    """The command line of ``pid``, or ``?``."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    return "?"


def kill_pid(pid: int) -> None:
    """SIGKILL ``pid`` (one we started), ignoring a process already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def become_subreaper() -> bool:
    """Adopt our children's orphans (prctl PR_SET_CHILD_SUBREAPER) so that none escapes us."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def our_children() -> list[int]:
    """Pids whose parent is this process (zombies included)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat[1] == me:
                found.append(int(entry))
    return found


def marked_pids(mark: str, keep: Collection[int] = ()) -> list[int]:
    """Live processes, other than this one and ``keep``, whose environment carries the mark."""
    needle = f"{MARK_VAR}={mark}".encode()
    skip = {os.getpid(), *keep}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                environ = file.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def leftovers(mark: str | None, orphans: bool = False, keep: Collection[int] = ()) -> list[int]:
    """Live processes of a run: those carrying ``mark``, and with ``orphans`` (for a child
    subreaper with nothing of its own running) every live child not in ``keep``."""
    found = set(marked_pids(mark, keep)) if mark else set()
    if orphans:
        found.update(pid for pid in our_children() if pid not in keep and pid_alive(pid, True))
    return sorted(found)


def collect_leaks(
    mark: str | None,
    grace: float = 5.0,
    *,
    orphans: bool = False,
    keep: Collection[int] = (),
) -> list[str]:
    """What of a run is still alive ``grace`` seconds from now (see ``leftovers``), killed by
    pid: one line per process. Returns at once when nothing is left."""
    deadline = time.monotonic() + grace
    left = leftovers(mark, orphans, keep)
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = leftovers(mark, orphans, keep)
    described = []
    for pid in left:
        stat = proc_stat(pid)
        described.append(f"pid {pid} ({stat[0] if stat else '?'}) {cmdline(pid)[:100]}")
        kill_pid(pid)
    if left:
        time.sleep(0.05)
        for pid in left:
            pid_alive(pid, reap=orphans)  # reaps an adopted orphan's zombie
    return described


class LeakCheck:
    """A mark to put in the environment of everything a test starts; checked after it."""

    def __init__(self, mark: str | None = None) -> None:
        self.mark = mark or uuid.uuid4().hex

    @property
    def env(self) -> dict[str, str]:
        return {MARK_VAR: self.mark}

    def envs(self, nprocs: int, **extra: str) -> dict[int, dict[str, str]]:
        """One environment per local rank: the mark, ``LOCAL_RANK`` and ``extra``."""
        return {rank: {**self.env, "LOCAL_RANK": str(rank), **extra} for rank in range(nprocs)}

    def process_env(self, **extra: str) -> dict[str, str]:
        """A full environment for a process the test starts itself (e.g. the relaunch CLI)."""
        return {**os.environ, **self.env, **extra}

    def run_python(self, code: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``python -c code`` run to its end (its output captured), marked."""
        return subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=self.process_env(),
            timeout=timeout,
        )

    def start_relaunch(self, *argv: str, **extra: str) -> subprocess.Popen[str]:
        """``relaunch ARGV`` started, marked, ``extra`` in its environment: its stdout
        discarded, its stderr a text pipe."""
        return subprocess.Popen(
            [sys.executable, "-m", "relaunch", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=self.process_env(**extra),
        )

    def collect(self, grace: float = 5.0, keep: Collection[int] = ()) -> list[str]:
        """The marked processes still alive after ``grace`` s, killed by pid (collect_leaks)."""
        return collect_leaks(self.mark, grace, keep=keep)


class LinesRead:
    """The lines a process writes on a text pipe, each with the time it was read, read on a
    thread as they come: a test waits on them while the process runs."""

    def __init__(self, stream: Iterable[str]) -> None:
        self.timed: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Iterable[str]) -> None:
        for line in stream:
            self.timed.append((time.time(), line))

    @property
    def lines(self) -> list[str]:
        return [line for _, line in list(self.timed)]

    def text(self) -> str:
        return "".join(self.lines)

    def count(self, text: str) -> int:
        """How many lines hold ``text``."""
        return sum(text in line for line in self.lines)

    def first(self, text: str) -> float | None:
        """When the first line holding ``text`` was read; None before there is one."""
        return next((at for at, line in list(self.timed) if text in line), None)

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the pipe's end (the process ended) and every line before it."""
        self._thread.join(timeout)
