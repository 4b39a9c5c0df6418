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
#: The last signal's exception, until the code that acts on it says it has it (``take_signal``).
#: Raised inside a ``__del__`` or a garbage collector's callback, or caught by an ``except
#: Exception`` meant for something else, it would be lost, and the stop with it.
_untaken: SignalException | None = None


def raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    """The handler: the first SIGTERM/SIGINT/SIGUSR1 raises ``StopRequested``, any other (or any
    later) termination signal ``SignalException``; both carry ``sigval``."""
    global _stop_requested, _untaken
    sigval = signal.Signals(signum)
    said = f"process {os.getpid()} got signal {sigval.name}"
    if sigval in GRACEFUL_SIGNALS and not _stop_requested:
        _stop_requested = True
        _untaken = StopRequested(said, sigval=sigval)
    else:
        _untaken = SignalException(said, sigval=sigval)
    raise _untaken


def take_signal(exc: BaseException | None) -> None:
    """Say that ``exc``, a signal's exception, reached the code that acts on it; None forgets
    any earlier one (a run starts)."""
    global _untaken
    if exc is None or exc is _untaken:
        _untaken = None


def raise_untaken_signal() -> None:
    """Raise again the last signal's exception if it never reached the code that acts on it
    (``take_signal``): the agent's loop calls this before it sleeps."""
    global _untaken
    lost, _untaken = _untaken, None
    if lost is not None:
        raise lost


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
