"""One started worker process, seen the same way whether it is a binary or a function."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from relaunch.core.value import Value
from relaunch.runtime import start_thread

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (the worker and all it started).

    Falls back to the process alone while it has not yet made its own group.
    """
    try:
        os.killpg(pid, sig)
        return
    except ProcessLookupError:
        pass
    except PermissionError:
        log.debug("no permission to signal process group %d", pid)
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_groups_gone(groups: Collection[int], timeout: float, ignore: Collection[int] = ()) -> bool:
    """Wait up to ``timeout`` seconds for every live process of the process ``groups`` (just
    sent SIGKILL) to die; True once none is left. No scan at all while the groups are empty,
    as they are when workers started nothing; otherwise their members are found once in
    /proc and waited for on pidfds, not polled. The pids in ``ignore`` (workers already known
    not to die) are not waited for."""
    occupied = [group for group in groups if _group_exists(group)]
    if not occupied:
        return True
    fds = []
    for pid in _live_members(set(occupied)):
        if pid in ignore:
            continue
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue
        except (AttributeError, OSError):  # no pidfds here: do not wait
            break
    deadline = time.monotonic() + timeout
    try:
        pending = set(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                log.debug("%d process(es) of the stopped groups are still alive", len(pending))
                return False
            ready, _, _ = select.select(pending, [], [], left)
            pending.difference_update(ready)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_members(groups: set[int]) -> list[int]:
    """Processes of ``groups`` that have not exited (zombies are done: they only await a wait)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) in groups and fields[0] not in (b"Z", b"X"):
            members.append(int(entry))
    return members


#: What the state letter of /proc/<pid>/stat means (proc(5)).
_STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep",
    "Z": "zombie",
    "T": "stopped",
    "t": "tracing stop",
    "X": "dead",
    "I": "idle",
    "P": "parked",
    "W": "waking",
}


class StuckWorker(Value):
    """A worker that outlived its SIGKILL, as /proc showed it when relaunch gave up on it.

    ``state`` is its state letter and meaning (``"D (uninterruptible sleep)"``), ``wchan`` the
    kernel function it sleeps in (where the kernel tells), ``tracer`` the pid of a process
    tracing it (a debugger: only that one can reap a traced zombie first), 0 if none.
    """

    __slots__ = ("pid", "state", "tracer", "wchan")

    pid: int
    state: str
    wchan: str
    tracer: int

    def __init__(self, pid: int, state: str, wchan: str = "", tracer: int = 0) -> None:
        self._set(pid=pid, state=state, wchan=wchan, tracer=tracer)

    def __str__(self) -> str:
        text = f"pid {self.pid} in state {self.state}"
        if self.wchan:
            text += f", waiting in {self.wchan}"
        if self.tracer:
            text += f", traced by pid {self.tracer}"
        return text


def stuck_worker(pid: int) -> StuckWorker:
    """How process ``pid`` stands now, read from /proc (``"? (gone)"`` if it has no entry)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return StuckWorker(pid, "? (gone)")
    letter = stat[stat.rindex(b")") + 2 :].split()[0].decode()
    state = f"{letter} ({_STATE_NAMES.get(letter, 'unknown')})"
    return StuckWorker(pid, state, _read_proc(pid, "wchan"), _tracer_of(pid))


def _read_proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", encoding="ascii", errors="replace") as file:
            text = file.read().strip()
    except OSError:
        return ""
    return "" if text == "0" else text


def _tracer_of(pid: int) -> int:
    for line in _read_proc(pid, "status").splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    return 0


def _exit_fd(pid: int, wait: Callable[[], object]) -> int:
    """A file descriptor that becomes readable when process ``pid`` exits: no polling needed.

    Uses a pidfd where the kernel has them, otherwise a pipe closed by a thread that waits.
    """
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    read_end, write_end = os.pipe()

    def wait_then_close() -> None:
        try:
            wait()
        finally:
            os.close(write_end)

    start_thread(wait_then_close, f"relaunch-wait-{pid}")
    return read_end


class PopenHandle:
    """A worker binary started with ``subprocess.Popen``."""

    #: Where the exit status comes after the exit itself (``exit_fd``) was seen, a descriptor
    #: that becomes readable when it does (a zygote's child: ``procs.zygote_handle``); None: the
    #: status is there as soon as the exit is.
    status_fd: int | None = None

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.exit_fd = _exit_fd(self.pid, popen.wait)

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit code, waiting up to ``timeout`` seconds; None if it has not exited."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def abandon(self) -> None:
        """Nothing to do: ``subprocess`` reaps a dropped ``Popen`` later, waiting for nothing."""

    def release(self) -> None:
        os.close(self.exit_fd)


class ProcessHandle:
    """A function worker started with ``multiprocessing``."""

    status_fd: int | None = None  # as ``PopenHandle.status_fd``

    def __init__(self, process: BaseProcess, start_method: str) -> None:
        self.process = process
        assert process.pid is not None
        self.pid = process.pid
        if start_method == "forkserver":
            # Not our child: its exit status arrives through the forkserver's sentinel.
            self.exit_fd = os.dup(process.sentinel)
        else:
            self.exit_fd = _exit_fd(self.pid, process.join)

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float) -> int | None:
        """The exit code, waiting up to ``timeout`` seconds; None if it has not exited."""
        self.process.join(timeout)
        return self.process.exitcode

    def abandon(self) -> None:
        """Forget a worker that would not die: ``multiprocessing`` joins every child it started
        at interpreter exit, which would hang the launcher on this one forever."""
        process_module = sys.modules.get("multiprocessing.process")
        children = getattr(process_module, "_children", None)
        if isinstance(children, set):
            children.discard(self.process)

    def release(self) -> None:
        os.close(self.exit_fd)
        try:
            self.process.close()
        except ValueError:
            pass  # still running: only possible when it could not be killed
