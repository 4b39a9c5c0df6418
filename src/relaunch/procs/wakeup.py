"""A queue one thread sleeps on until another thread posts to it, or, in the main thread, until
a signal arrives; and a ``Latch`` (a one-shot flag) waited for the same way.

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
import time
from collections.abc import Callable
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
            # Both or neither: a handler raising between them would leave the wake-up fd ours
            # with nothing to give it back (close() restores ``_previous_fd``).
            with signals_deferred():
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
            if threading.current_thread() is threading.main_thread():
                # A signal's exception may have cut the restore short, even between setting
                # the fd and noting the one before (a signal another thread caught runs its
                # handler in the main thread at any instruction, deferred or not): whatever
                # is left of ours goes.
                current = signal.set_wakeup_fd(-1)
                if self._previous_fd is not None:
                    current = self._previous_fd
                elif current == self._write_fd:
                    current = -1
                signal.set_wakeup_fd(current)
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


class Latch:
    """A flag set once, from any thread: its waiters wake and its callbacks run (in the setting
    thread: they must be quick). The main thread waits on an ``EventQueue``, so a signal wakes it
    at once and its exception is never raised inside a lock."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the flag is set: at once (here) if it is already."""
        with signals_deferred(), self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the flag is set, waiting up to ``timeout`` seconds (None: no limit)."""
        if threading.current_thread() is not threading.main_thread():
            return self._event.wait(timeout)
        if self._event.is_set() or timeout == 0:
            return self._event.is_set()
        deadline = None if timeout is None else time.monotonic() + timeout
        with EventQueue[None]() as woken:

            def wake() -> None:
                woken.put(None)

            self.add_callback(wake)
            try:
                while not self._event.is_set():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    woken.get(left)
                return True
            finally:
                with signals_deferred(), self._lock:
                    if wake in self._callbacks:
                        self._callbacks.remove(wake)
