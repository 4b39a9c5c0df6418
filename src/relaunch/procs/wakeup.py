"""A queue one thread sleeps on until another thread posts to it, or, in the main thread, until
a signal arrives.

Threads ``put`` events; the waiting thread's ``get`` sleeps in ``poll`` on a self-pipe, so it
wakes only when there is something to do. In the main thread the pipe is also Python's signal
wake-up fd (``signal.set_wakeup_fd``) for the length of the wait: a signal handled while the main
thread sleeps, or an instant before it does, wakes it at once and its handler runs, raising
``SignalException`` out of ``get``. No lock is held while the main thread waits or takes events
(a deque is safe to share), so a signal's exception cannot land inside lock code and leave a lock
held, as one raised inside ``Condition.wait`` could.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import threading
from typing import Generic, TypeVar

from relaunch.procs.signals import signals_deferred

T = TypeVar("T")


class EventQueue(Generic[T]):
    """Events from any thread, taken by one waiting thread; a signal wakes the main thread."""

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._poll = select.poll()
        self._poll.register(self._read_fd, select.POLLIN)
        self._lock = threading.Lock()  # keeps ``put`` from writing to a closed (reused) fd
        self._closed = False
        self._previous_fd: int | None = None  # the signal wake-up fd to give back after a wait

    def put(self, item: T) -> None:
        """Add ``item`` and wake the waiting thread; from any thread. A no-op once closed."""
        self._items.append(item)
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:
                pass  # the pipe is full: the waiter is awake already

    def get(self, timeout: float | None = None) -> list[T]:
        """The events queued, waiting up to ``timeout`` seconds (None: no limit) for one.

        Returns early, maybe with none, when the main thread was woken by a signal whose handler
        did not raise.
        """
        if not self._items and (timeout is None or timeout > 0):
            self._sleep(timeout)
        self._drain()  # first: a wake-up still in the pipe then stands for an item not taken
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

    def _sleep(self, timeout: float | None) -> None:
        in_main = threading.current_thread() is threading.main_thread()
        previous = -1
        if in_main:
            previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            self._previous_fd = previous
        try:
            self._poll.poll(None if timeout is None else timeout * 1000)
        finally:
            if in_main:
                signal.set_wakeup_fd(previous)
                self._previous_fd = None

    def _drain(self) -> None:
        try:
            while os.read(self._read_fd, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Release the pipe; later ``put`` calls only queue (nobody waits any more)."""
        with signals_deferred():
            if self._previous_fd is not None:  # a signal's exception cut the restore short
                signal.set_wakeup_fd(self._previous_fd)
                self._previous_fd = None
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                os.close(self._read_fd)
                os.close(self._write_fd)

    def __enter__(self) -> EventQueue[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
