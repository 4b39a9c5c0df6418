"""Restarting in place: ``@relaunch.restart_in_place`` keeps a surviving rank's process, and
what it holds in memory, across a restart of its group; ``relaunch.resumes_from`` tells it
whether what it holds is what the restarted world resumes from.

When the wrapped function raises (a collective failed because a peer died), the rank does not
exit: it lets go of what the failed call held (its frames' locals, then torch's process group,
if one is left), tells its agent it waits (``parked``, on the parking lot: a Unix socket the
agent serves, ``PARKING_ENV``), and blocks. The agent then either hands it the next attempt
(its environment, and the attempt's stdout and stderr as descriptors) and the function is
called again in the same process, or says ``go on``: the exception was the rank's own (no
failure or restart explains it), and it is raised as without relaunch. Outside relaunch the
decorator does nothing. The agent's side is ``agent.parking``.
"""

from __future__ import annotations

import functools
import os
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs a worker milliseconds
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any, TypeVar

    Result = TypeVar("Result")

#: Where the agent's parking lot listens (a Unix ``SOCK_SEQPACKET`` socket, mode 0600).
PARKING_ENV = "RELAUNCH_PARKING"
#: What a rank says (``PARKED``) and what the agent answers: ``GO_ON``, or ``RESUME`` followed by
#: the next attempt's environment (``KEY=VALUE`` lines, NUL-separated) with its stdout and
#: stderr as ``SCM_RIGHTS`` descriptors.
PARKED = b"parked"
GO_ON = b"go on"
RESUME = b"resume\0"
#: The largest message the agent sends (an environment), and descriptors it passes.
MAX_MESSAGE = 1 << 20
STREAMS = (1, 2)

_lot: socket.socket | None = None
_resumed = False  # this process runs an attempt it was handed in place


def _forget() -> None:
    """In a forked child: the parent's connection is the parent's."""
    global _lot, _resumed
    _lot, _resumed = None, False


os.register_at_fork(after_in_child=_forget)


def restart_in_place(function: Callable[..., Result]) -> Callable[..., Result]:
    """Run ``function`` so that, under relaunch, the rank's process outlives a failure of its
    group: when ``function`` raises, the rank waits for the group's restart and calls it again
    in the same process, with the new attempt's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``...) and log files. Whatever ``function``
    keeps outside its own frames (a model in a closure or a global) survives; check with
    ``resumes_from`` that it is what the world resumes from. An exception that no failure
    elsewhere explains is raised as usual, and the rank fails with it."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Result:
        lot = _connect()
        if lot is None:
            return function(*args, **kwargs)
        import gc

        # What the imports made stays: the collection before each park then walks only what
        # the calls made (torch's imports are 280,000 objects: 0.4 s a collection, per rank).
        gc.freeze()
        while True:
            try:
                return function(*args, **kwargs)
            except Exception as exc:
                failure = exc
            _let_go(failure)
            environment = _park(lot, failure)
            if environment is None:
                raise failure
            del failure
            _take_attempt(environment)

    return run


def resumes_from(step: int | None) -> bool:
    """Whether this rank, restarted in place and holding the state of ``step`` in memory, may
    go on from it: the step every rank of the restarted world resumes from is ``step``
    (``load_state`` would give it). False in a process that was not restarted in place."""
    from relaunch.core.workers.state import STATE_STEP_ENV

    if not _resumed or step is None or os.environ.get(STATE_STEP_ENV) != str(step):
        return False
    import time

    from relaunch.worker import note_restore

    now = time.time()
    note_restore(now, now, step)  # restored in no time: the goodput ledger's restore closes
    return True


def _connect() -> socket.socket | None:
    """The connection to this worker's parking lot, made once; None outside relaunch."""
    global _lot
    if _lot is not None:
        return _lot
    path = os.environ.get(PARKING_ENV)
    if not path:
        return None
    import socket

    lot = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        lot.connect(path)
    except OSError as exc:
        lot.close()
        print(f"relaunch: cannot restart in place ({path}: {exc.strerror})", file=sys.stderr)
        return None
    _lot = lot
    return lot


def _let_go(failure: BaseException) -> None:
    """Free what the failed call held before its process group is destroyed: the group's last
    holder freed under the GIL deadlocks torch 2.13's gloo in its destructor."""
    import gc
    import traceback

    traceback.clear_frames(failure.__traceback__)
    gc.collect()
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        try:
            distributed.destroy_process_group()
        except Exception as exc:  # the group is broken already: what matters is that it goes
            print(f"relaunch: destroy_process_group: {exc}", file=sys.stderr)
        gc.collect()


def _park(lot: socket.socket, failure: BaseException) -> dict[str, str] | None:
    """Say ``parked`` and wait for the agent: the next attempt's environment, or None to
    raise ``failure`` (the agent said ``go on``, or is gone)."""
    import socket

    rank = os.environ.get("RANK", "?")
    line = str(failure).strip().splitlines()
    why = f"{type(failure).__name__}: {line[0]}" if line else type(failure).__name__
    print(f"relaunch: rank {rank}: {why}; waiting to restart in place", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        lot.sendall(PARKED)
        message, descriptors, _, _ = socket.recv_fds(lot, MAX_MESSAGE, len(STREAMS))
    except OSError:
        message, descriptors = b"", []
    if not message.startswith(RESUME) or len(descriptors) != len(STREAMS):
        for fd in descriptors:
            os.close(fd)
        return None
    for fd, stream in zip(descriptors, STREAMS, strict=True):
        os.dup2(fd, stream)
        os.close(fd)
    text = message[len(RESUME) :].decode("utf-8", "surrogateescape")
    return dict(item.split("=", 1) for item in text.split("\0") if "=" in item)


def _take_attempt(environment: dict[str, str]) -> None:
    """This process runs the next attempt: its environment, and relaunch's worker modules
    looking at the channel and the kept state afresh."""
    global _resumed
    os.environ.clear()
    os.environ.update(environment)
    _resumed = True
    worker = sys.modules.get("relaunch.worker")
    if worker is not None:
        worker._forget()
    state = sys.modules.get("relaunch.state.api")
    if state is not None:
        state._reopen()
