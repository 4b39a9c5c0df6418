"""The event queue the main thread sleeps on: woken by other threads and by signals."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from relaunch.procs.errors import SignalException
from relaunch.procs.signals import raise_signal_exception
from relaunch.procs.wakeup import EventQueue, Latch

pytestmark = pytest.mark.timeout(30)


def wakeup_fd() -> int:
    current = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(current)
    return current


def test_an_event_put_by_another_thread_wakes_the_waiter() -> None:
    with EventQueue[str]() as queue:
        thread = threading.Thread(target=queue.put, args=("ended",))
        thread.start()
        assert queue.get(20) == ["ended"]  # the item is queued before the waiter is woken
        thread.join()


def test_events_are_taken_in_order_without_waiting() -> None:
    with EventQueue[int]() as queue:
        for item in range(3):
            queue.put(item)
        started = time.monotonic()
        assert queue.get(10) == [0, 1, 2]
        assert time.monotonic() - started < 5
        assert queue.get(0) == []


def test_get_returns_nothing_after_its_timeout_and_restores_the_wakeup_fd() -> None:
    before = wakeup_fd()
    with EventQueue[str]() as queue:
        started = time.monotonic()
        assert queue.get(0.05) == []
        assert time.monotonic() - started >= 0.05
    assert wakeup_fd() == before


def test_a_signal_taken_by_another_thread_wakes_the_main_thread() -> None:
    previous = signal.signal(signal.SIGUSR1, raise_signal_exception)
    sent: list[float] = []

    def send() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGUSR1)

    try:
        with EventQueue[str]() as queue, pytest.raises(SignalException) as caught:
            threading.Thread(target=send).start()
            queue.get(20)
        assert caught.value.sigval is signal.SIGUSR1
        assert time.monotonic() - sent[0] < 5
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert wakeup_fd() == -1


def test_put_after_close_does_nothing() -> None:
    queue = EventQueue[str]()
    queue.close()
    queue.put("late")  # no write to a closed (maybe reused) fd
    queue.close()


def test_a_latch_set_by_another_thread_wakes_the_main_thread_and_runs_callbacks_once() -> None:
    latch = Latch()
    calls: list[str] = []
    latch.add_callback(lambda: calls.append("early"))
    assert not latch.wait(0) and not latch.wait(0.01)
    setter = threading.Thread(target=latch.set)
    setter.start()
    assert latch.wait(20)
    setter.join()
    latch.set()  # a second set changes nothing
    latch.add_callback(lambda: calls.append("late"))  # already set: called at once
    assert calls == ["early", "late"]
    assert wakeup_fd() == -1


def test_a_latch_is_waited_for_in_other_threads_too() -> None:
    latch = Latch()
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(latch.wait(20)))
    waiter.start()
    latch.set()
    waiter.join()
    assert seen == [True]
