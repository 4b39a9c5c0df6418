"""The runtime seam: how relaunch's helper threads are started, and the clock they read.

Code that keeps deadlines takes a ``Clock`` (default ``SYSTEM_CLOCK``), so a test can drive it
with a clock of its own instead of patching ``time.monotonic`` for the whole process.

Every long-lived helper thread (the group monitor, the console, the store server, timer servers,
heartbeats) starts through ``start_thread``, so none dies silently: an exception that ends one
is handed to ``THREAD_FAILURES`` (or the thread's own ``on_failure``), where the agent's event
loop hears it and ends the run with one line naming the thread and the cause (without an agent,
the line is logged). Each also starts with the termination signals blocked: the kernel gives a
process-directed signal to any thread that does not block it, and taken by a helper it would
only set Python's flag while the main thread, asleep in a wait, ran its handler a timeout late.

``raise_open_file_limit`` lifts the soft open-file limit of a process that will hold many
connections (the built-in store's server).
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: The signals the CLI turns into exceptions in the main thread; helper threads block them.
TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: Those, and Slurm's warning (SIGUSR1, when ``--signals-to-handle`` has it): what helper threads
#: block and lock code defers, so that a handler's exception never lands inside a lock.
DEFERRED_SIGNALS = (*TERMINATION_SIGNALS, signal.SIGUSR1)
#: What a helper thread blocks: those, and SIGCHLD. A child's end is the main thread's to hear
#: (the replica groups' supervisor waits for it in ``sigwaitinfo``); a helper thread that let
#: it in would take it while the main thread is between two waits, and discard it. A process
#: started from a helper thread inherits this mask: it sets its own (the lighthouse does).
HELPER_BLOCKED = (*DEFERRED_SIGNALS, signal.SIGCHLD)


class ThreadFailed(Exception):
    """A helper thread ended with an exception: ``thread`` names it, ``error`` is what it raised.
    ``str()`` is the one line to tell the user."""

    def __init__(self, thread: str, error: BaseException) -> None:
        self.thread, self.error = thread, error
        super().__init__(describe_failure(thread, error))


def describe_failure(thread: str, error: BaseException) -> str:
    """One line for the death of ``thread`` by ``error``: an error that explains itself (one of
    relaunch's own, ``ExplainedError``) is its own message; any other names the thread too."""
    if isinstance(error, ExplainedError):
        return str(error)
    text = " ".join(str(error).split()) or "(no message)"
    return f"relaunch's {thread} thread failed: {type(error).__name__}: {text}"


class ExplainedError(Exception):
    """An error whose message, alone, tells the user what went wrong (a bad value read from the
    store names its key): a thread it ends is not named."""


class ThreadFailures:
    """Where helper threads' failures go: the first one since a watcher began is kept for it,
    and its callback is called (from the failing thread) to wake whoever must act on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: list[FailureWatch] = []

    def watch(self, wake: Callable[[], None] = lambda: None) -> FailureWatch:
        """Keep the failures reported from now on (until ``close``), calling ``wake`` for each."""
        watch = FailureWatch(self, wake)
        with self._lock:
            self._watchers.append(watch)
        return watch

    def _unwatch(self, watch: FailureWatch) -> None:
        with self._lock:
            if watch in self._watchers:
                self._watchers.remove(watch)

    def report(self, thread: str, error: BaseException) -> None:
        """``thread`` failed with ``error``: tell the watchers; with none, log it in one line."""
        failure = error if isinstance(error, ThreadFailed) else ThreadFailed(thread, error)
        log.debug("the %s thread failed", thread, exc_info=error)
        with self._lock:
            watchers = list(self._watchers)
        if not watchers:
            log.error("%s", failure)
        for watch in watchers:
            watch._take(failure)


class FailureWatch:
    """The failures of helper threads one watcher (an agent's run) hears of."""

    def __init__(self, failures: ThreadFailures, wake: Callable[[], None]) -> None:
        self._failures, self._wake = failures, wake
        self.failure: ThreadFailed | None = None  # the first one reported

    def _take(self, failure: ThreadFailed) -> None:
        if self.failure is None:
            self.failure = failure
        try:
            self._wake()
        except Exception:  # waking must not fail the report
            log.debug("could not wake the watcher of thread failures", exc_info=True)

    def check(self) -> None:
        """Raise the first failure heard of (``ThreadFailed``), if any."""
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        self._failures._unwatch(self)


#: The process's thread failures: ``start_thread`` reports here unless given ``on_failure``.
THREAD_FAILURES = ThreadFailures()


def report_failure(thread: str, error: BaseException) -> None:
    """Report that ``thread`` failed with ``error`` (for a callback's failure that a thread
    survives, as much as for a thread's death)."""
    THREAD_FAILURES.report(thread, error)


def start_thread(
    target: Callable[..., Any],
    name: str,
    *args: Any,
    daemon: bool = True,
    on_failure: Callable[[str, BaseException], None] | None = None,
) -> threading.Thread:
    """A thread (daemon by default) running ``target(*args)``, started with ``HELPER_BLOCKED``
    blocked in it (a thread inherits the mask). An exception that ends it goes to
    ``on_failure(name, error)`` (by default ``report_failure``), never to a traceback."""
    report = on_failure or report_failure

    def run() -> None:
        try:
            target(*args)
        except BaseException as error:  # reported, never silent
            try:
                report(name, error)
            except BaseException:  # the last word: one line, still no traceback
                log.error("%s", describe_failure(name, error))

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_BLOCKED)
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


def descriptor_share(most: int) -> int:
    """How many connections a server of this process may hold for clients that proved nothing
    yet: a quarter of the soft open-file limit, at least 8 and at most ``most``. The rest stays
    for the process's own work (its workers' pipes, its logs, its other servers), so that idle
    clients cannot take the descriptors it needs."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    share = most if soft == resource.RLIM_INFINITY else soft // 4
    return max(8, min(most, share))


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


def lazy_attributes(module: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` (PEP 562) that imports each name of ``homes`` from the module
    named beside it on first use, so that importing ``module`` stays cheap."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(home), name)

    return __getattr__


#: ``prctl``'s option that sends a signal to the caller when its parent ends (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def end_with_parent(sig: signal.Signals, parent: int) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that started it ends, and
    whether ``parent`` (the pid that started it) is still its parent: False when it ended
    before the request was made (the signal will then never come). Where the kernel cannot be
    asked, only the second."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    return os.getppid() == parent
