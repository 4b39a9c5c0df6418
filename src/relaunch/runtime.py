"""The runtime seam: how relaunch's helper threads are started, and the clock they read.

Code that keeps deadlines takes a ``Clock`` (default ``SYSTEM_CLOCK``), so a test can drive it
with a clock of its own instead of patching ``time.monotonic`` for the whole process.

Every long-lived helper thread (the group monitor, the console, the store server, timer servers,
heartbeats) starts through ``start_thread``, so each starts with the termination signals
blocked: the kernel gives a process-directed signal to any thread that does not block it, and
taken by a helper it would only set Python's flag while the main thread, asleep in a wait, ran
its handler a timeout late.

``raise_open_file_limit`` lifts the soft open-file limit of a process that will hold many
connections (the built-in store's server).
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

#: The signals the CLI turns into exceptions in the main thread; helper threads block them.
TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: Those, and Slurm's warning (SIGUSR1, when ``--signals-to-handle`` has it): what helper threads
#: block and lock code defers, so that a handler's exception never lands inside a lock.
DEFERRED_SIGNALS = (*TERMINATION_SIGNALS, signal.SIGUSR1)


def start_thread(
    target: Callable[..., Any], name: str, *args: Any, daemon: bool = True
) -> threading.Thread:
    """A thread (daemon by default) running ``target(*args)``, started with the termination
    signals blocked in it (a thread inherits the mask)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread


class Clock(Protocol):
    """Where deadlines come from: ``monotonic()`` for intervals, ``time()`` for timestamps."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The process's real clocks."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that moves only when told to (``advance``): tests drive deadlines with it."""

    def __init__(self, monotonic: float = 1000.0, time: float = 1.7e9) -> None:
        self._monotonic = monotonic
        self._time = time

    def monotonic(self) -> float:
        return self._monotonic

    def time(self) -> float:
        return self._time

    def advance(self, seconds: float) -> None:
        """Move both clocks ``seconds`` forward."""
        self._monotonic += seconds
        self._time += seconds


def open_descriptors() -> int:
    """How many file descriptors this process has open now (0 where /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def raise_open_file_limit(needed: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit when it is below ``needed``; the (soft,
    hard) limits after. Children inherit the soft limit, so it is left alone when it suffices;
    a limit the kernel refuses (over ``fs.nr_open``) stays as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = hard if hard != resource.RLIM_INFINITY else max(needed, soft)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard
