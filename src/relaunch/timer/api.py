"""The timer API of the seed: requests, clients, servers, ``configure`` and ``expires``.

A worker says "this block must finish within N seconds" (``with expires(after=N):``); its client
sends an acquire request to a server in the agent, and a release when the block ends. A server
that sees a deadline pass reaps the worker. Server and client come in pairs that share a
message protocol: ``LocalTimerServer``/``LocalTimerClient`` over a multiprocessing queue,
``FileTimerServer``/``FileTimerClient`` over a named pipe. The classes live in ``timer.base``,
below both pairs; they are named here too, where the seed has them.

Deadlines are ``time.time()`` seconds, a clock every process on a host shares.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from relaunch.core.workers.timers import ENABLE_FILE_TIMER_ENV, TIMER_FILE_ENV
from relaunch.timer.base import RequestQueue, TimerClient, TimerRequest, TimerServer

__all__ = [
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "configure",
    "expires",
]

_client: TimerClient | None = None


def configure(timer_client: TimerClient) -> None:
    """Make ``timer_client`` the one ``expires`` uses when it is given none."""
    global _client
    _client = timer_client


def _configured_client() -> TimerClient:
    if _client is not None:
        return _client
    path = os.environ.get(TIMER_FILE_ENV)
    if path:
        from relaunch.timer.file_based_local_timer import FileTimerClient

        configure(FileTimerClient(path))
        assert _client is not None
        return _client
    raise RuntimeError(
        "relaunch.timer.expires: no timer client is configured: call "
        "relaunch.timer.configure(client), or run under `relaunch --timers` (or "
        f"{ENABLE_FILE_TIMER_ENV}=1), which sets {TIMER_FILE_ENV}"
    )


def _caller_scope() -> str:
    frame = sys._getframe(3)  # the caller of the ``with``, past contextmanager's frames
    return f"{frame.f_code.co_filename}#{frame.f_lineno}"


@contextmanager
def expires(
    after: float, scope: str | None = None, client: TimerClient | None = None
) -> Iterator[None]:
    """``with expires(after=60):``: the worker may be reaped if the block runs past 60 s.

    ``scope`` names the timer (by default the caller's ``file#line``); ``client`` defaults to
    the configured one, or under ``relaunch --timers`` to the agent's file timer server.
    """
    if (
        isinstance(after, bool)
        or not isinstance(after, (int, float))
        or not (after > 0 and math.isfinite(after))
    ):
        raise ValueError(f"expires(after={after!r}): expected a positive number of seconds")
    timer_client = client or _configured_client()
    scope_id = scope if scope is not None else _caller_scope()
    timer_client.acquire(scope_id, time.time() + after)
    try:
        yield
    finally:
        timer_client.release(scope_id)
