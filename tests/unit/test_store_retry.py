"""The store clients' one backoff, and their deadlines, driven by a manual clock: no real sleeps."""

from __future__ import annotations

import pytest

from relaunch.runtime import ManualClock
from relaunch.store import deadline
from relaunch.store.deadline import Deadline
from relaunch.store.etcd_shapes import compare_set, event_value, prefix_end, prefix_range, put
from relaunch.store.retry import Backoff


def pauses_until_given_up(seconds: float) -> list[float]:
    """The pauses a ``Backoff`` of ``seconds`` sleeps, the clock moving by each, until it gives
    up."""
    clock = ManualClock()
    slept: list[float] = []

    def sleep(pause: float) -> None:
        slept.append(pause)
        clock.advance(pause)

    backoff = Backoff(clock.monotonic() + seconds, clock, sleep)
    while backoff.pause():
        pass
    return slept


def test_pauses_double_from_10_ms_up_to_half_a_second() -> None:
    slept = pauses_until_given_up(3.0)
    assert slept[:7] == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5])
    assert set(slept[6:]) == {0.5}


def test_it_gives_up_when_the_time_left_is_shorter_than_the_next_pause() -> None:
    slept = pauses_until_given_up(1.0)
    assert slept == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32])  # 0.63 s; 0.5 > 0.37
    assert pauses_until_given_up(0.005) == []


def test_a_deadline_on_a_manual_clock_moves_with_it_and_ignores_a_limit() -> None:
    clock = ManualClock()
    with deadline.limit(0.001):
        bound = Deadline(10.0, clock)
    assert bound.left() == 10.0
    part = bound.within(4.0)
    clock.advance(4.0)
    assert part.expired() and not bound.expired()
    with pytest.raises(TimeoutError):
        part.timeout()
    assert bound.timeout() == 6.0


def test_etcd_requests_are_built_without_io() -> None:
    assert prefix_end("a/") == "YTA="  # "a0": the first key past every "a/..."
    assert prefix_range("a/", limit=2) == {"key": "YS8=", "range_end": "YTA=", "limit": "2"}
    assert put("k", b"v", previous=True) == {
        "request_put": {"key": "aw==", "value": "dg==", "prev_kv": True}
    }
    body = compare_set("k", 7, b"v", also=("j",))
    assert body["compare"][0]["mod_revision"] == "7"
    assert [next(iter(op)) for op in body["success"]] == ["request_put"] * 2 + ["request_range"]
    assert event_value({"type": "DELETE", "kv": {"key": "aw=="}}) == (None, 0)
    assert event_value({"kv": {"key": "aw==", "value": "dg==", "mod_revision": "9"}}) == (b"v", 9)
