"""What runs first inside a function worker (kept light: a spawned child imports it)."""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class InheritedFd:
    """A file descriptor handed to a multiprocessing child, whatever the start method.

    Under spawn and forkserver, pickling goes through ``multiprocessing.reduction.DupFd`` so the
    child receives its own copy; under fork the number is simply inherited.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(duplicate: Any) -> InheritedFd:
    return InheritedFd(duplicate.detach())


@dataclass(frozen=True)
class ChildSetup:
    """How a function worker's process is set up before the entrypoint runs."""

    env: dict[str, str]
    stdout: InheritedFd | None
    stderr: InheritedFd | None
    #: The CPUs it runs on (``--numa-binding``; None: any).
    cpus: frozenset[int] | None = None


def run_function(
    setup: ChildSetup,
    entrypoint: Callable[..., Any],
    args: tuple[Any, ...],
    result: InheritedFd,
) -> None:
    """Entry of a function worker: own process group, CPUs, clean signals, redirected streams,
    record; the return value goes to the pipe ``result`` by value (``procs.returns``)."""
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, stream_fd in ((setup.stdout, 1), (setup.stderr, 2)):
        if target is not None:
            os.dup2(target.fd, stream_fd)
            os.close(target.fd)
    if setup.cpus:
        try:
            os.sched_setaffinity(0, setup.cpus)
        except OSError as exc:
            os.write(2, f"relaunch: cannot bind to CPUs {sorted(setup.cpus)}: {exc}\n".encode())
    os.environ.update(setup.env)
    faulthandler.enable()

    from relaunch.procs.errors import callers_traceback, record
    from relaunch.procs.returns import send_return_value

    name = getattr(entrypoint, "__qualname__", None) or repr(entrypoint)
    rank = os.environ.get("RANK")
    who = name if rank is None else f"rank {rank}'s {name}"

    @record
    def call_and_send() -> None:
        value = entrypoint(*args)
        send_return_value(result.fd, value, who)
        os.close(result.fd)

    try:
        call_and_send()
    except Exception as exc:
        # What multiprocessing would print, from the entrypoint's frames on, not its own and
        # relaunch's; then its exit status for a failure (1), without a second traceback.
        import sys
        import traceback

        traceback.print_exception(type(exc), exc, callers_traceback(exc))
        sys.exit(1)
