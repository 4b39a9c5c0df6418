"""One started worker process, seen the same way whether it is a binary or a function."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
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
