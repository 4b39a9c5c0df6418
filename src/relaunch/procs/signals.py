"""Turning termination signals into ``SignalException`` in the main thread, for a context's life."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from relaunch.procs.errors import SignalException, StopRequested
from relaunch.runtime import DEFERRED_SIGNALS, TERMINATION_SIGNALS

#: The signals that first ask for a graceful stop (a preemption notice, a Ctrl-C); SIGUSR1 only
#: where it is handled (``--signals-to-handle``, which Slurm's inference extends with it).
GRACEFUL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
#: Notices, not orders: Slurm sends its warning (``sbatch --signal=USR1@90``) to every process
#: of the step, so workers start with it ignored where the agent handles it (``notices_ignored``).
NOTICE_SIGNALS = (signal.SIGUSR1,)

_stop_requested = False


def raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    """The handler: the first SIGTERM/SIGINT/SIGUSR1 raises ``StopRequested``, any other (or any
    later) termination signal ``SignalException``; both carry ``sigval``."""
    global _stop_requested
    sigval = signal.Signals(signum)
    if sigval in GRACEFUL_SIGNALS and not _stop_requested:
        _stop_requested = True
        raise StopRequested(f"process {os.getpid()} got signal {sigval.name}", sigval=sigval)
    raise SignalException(f"process {os.getpid()} got signal {sigval.name}", sigval=sigval)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold termination signals back while the main thread is inside a lock's code.

    Python raises a signal's exception wherever the main thread happens to be; raised inside
    ``Condition.wait`` or an ``RLock``'s bookkeeping, it can leave the lock held and deadlock
    the monitor thread. Deferred, it is raised when this block ends, outside any lock.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a deferred signal is raised here


@contextlib.contextmanager
def notices_ignored() -> Iterator[None]:
    """Ignore the handled ``NOTICE_SIGNALS`` while a worker is started, so that it starts with
    them ignored (an ignored signal stays ignored across fork and exec; a handled one does not)
    and Slurm's warning, sent to every process of the step, reaches only the agent. A notice that
    comes in these few microseconds is lost; SIGTERM at the time limit still stops the run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = [sig for sig in NOTICE_SIGNALS if signal.getsignal(sig) is raise_signal_exception]
    for sig in handled:
        signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig in handled:
            signal.signal(sig, raise_signal_exception)


def reset_stop_request() -> None:
    """Let the next SIGTERM/SIGINT ask for a graceful stop again."""
    global _stop_requested
    _stop_requested = False


#: The signals ``launch_agent`` says its agent handles (``LaunchConfig.signals_to_handle``), as
#: torch's agent reads them.
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


class SignalsToExceptions:
    """Install ``SignalException`` handlers where the default handler is in place; undo later.

    Handlers an application installed are left alone, and so is ``SIG_IGN`` (as under nohup),
    but for a signal ``TORCHELASTIC_SIGNALS_TO_HANDLE`` names: ``launch_agent`` sets it, and a
    signal it names is handled whatever was inherited, as torch's agent does (a shell starts a
    background job with SIGINT ignored). Nothing happens outside the main thread, where Python
    cannot install handlers.
    """

    def __init__(self) -> None:
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        named = {name.strip() for name in os.environ.get(SIGNALS_TO_HANDLE_ENV, "").split(",")}
        for sig in TERMINATION_SIGNALS:
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler) or (
                current == signal.SIG_IGN and sig.name in named
            ):
                self._previous[sig] = current
                signal.signal(sig, raise_signal_exception)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) is raise_signal_exception:
                signal.signal(sig, previous)
        self._previous.clear()
