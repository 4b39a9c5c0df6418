"""Binding a worker to CPUs (``--numa-binding``) from its first instruction, without numactl.

A process starts with the CPU affinity of the thread that forked it. So a binary worker is bound
by binding the launcher's starting thread around the one ``Popen``: three system calls in the
launcher, and the child runs bound before ``exec`` (no ``preexec_fn``, which would cost the fast
``vfork`` path and is unsafe with threads). A function worker binds itself first thing
in ``procs.function_worker.run_function`` (a forkserver's child would not inherit the starting
thread's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


@contextmanager
def starting_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread bound to ``cpus`` for the block (None or empty: as it is), then put
    back: threads and processes it starts in the block inherit the binding."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("cannot bind a worker to CPUs %s: %s; it runs on any CPU", sorted(cpus), exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
