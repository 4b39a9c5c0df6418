"""One started worker process, seen the same way whether it is a binary or a function."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

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


def wait_groups_gone(groups: Collection[int], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every live process of the process ``groups`` (just
    sent SIGKILL) to die; True once none is left. No scan at all while the groups are empty,
    as they are when workers started nothing; otherwise their members are found once in
    /proc and waited for on pidfds, not polled."""
    occupied = [group for group in groups if _group_exists(group)]
    if not occupied:
        return True
    fds = []
    for pid in _live_members(set(occupied)):
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

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.exit_fd = _exit_fd(self.pid, popen.wait)

    def poll(self) -> int | None:
        return self.popen.poll()

    def release(self) -> None:
        os.close(self.exit_fd)


class ProcessHandle:
    """A function worker started with ``multiprocessing``."""

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

    def release(self) -> None:
        os.close(self.exit_fd)
        try:
            self.process.close()
        except ValueError:
            pass  # still running: only possible when it could not be killed
