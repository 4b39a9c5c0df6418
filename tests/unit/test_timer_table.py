"""The pure parts of expiry timers: the table, hang detection, request parsing, ``expires``."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relaunch.core.run.failures import faulthandler_dump
from relaunch.core.workers.timers import Timer, TimerTable, expired_line, reap_signal, silent
from relaunch.timer import TimerClient, TimerRequest, expires
from relaunch.timer.file_based_local_timer import FileTimerRequest, parse_request


def test_a_timer_expires_at_its_deadline_and_not_before() -> None:
    table = TimerTable()
    table.acquire("w1", "step", deadline=10.0, now=9.5)
    assert table.next_deadline() == 10.0
    assert table.expired(9.999) == {}
    due = table.expired(10.0)
    assert list(due) == ["w1"] and due["w1"][0].scope == "step"
    assert due["w1"][0].allowed == pytest.approx(0.5)
    assert table.expired(100.0) == {} and table.next_deadline() is None and len(table) == 0


def test_a_reap_uses_the_first_signal_a_timer_named_else_the_default() -> None:
    named = [Timer(1, "a", 10.0, 9.0), Timer(1, "b", 10.0, 9.0, signal=15)]
    assert reap_signal(named, default=9) == 15
    assert reap_signal([Timer(1, "a", 10.0, 9.0)], default=9) == 9, "none named: the default"
    assert reap_signal([Timer(1, "a", 10.0, 9.0, signal=-1)], default=9) == -1, "only reported"


def test_an_expired_line_names_each_scope_and_how_long_it_was_given() -> None:
    timers = [Timer(1, "step", 70.0, 10.0), Timer(1, "io", 10.5, 10.0)]
    assert expired_line(timers) == (
        "expiry timer 'step' expired: the block was given 60s; "
        "expiry timer 'io' expired: the block was given 0.5s"
    )


def test_a_released_timer_never_fires() -> None:
    table = TimerTable()
    table.acquire("w1", "step", 10.0, 0.0)
    assert table.release("w1", "step") is True
    assert table.release("w1", "step") is False
    assert table.expired(1e9) == {} and table.next_deadline() is None


def test_scopes_and_workers_are_independent() -> None:
    table = TimerTable()
    table.acquire("w1", "a", 1.0, 0.0)
    table.acquire("w1", "b", 2.0, 0.0)
    table.acquire("w2", "a", 3.0, 0.0)
    table.release("w1", "a")
    assert table.next_deadline() == 2.0
    assert {w: [t.scope for t in ts] for w, ts in table.expired(2.5).items()} == {"w1": ["b"]}
    assert table.workers() == {"w2"}


def test_acquiring_a_scope_again_moves_its_deadline() -> None:
    table = TimerTable()
    table.acquire("w", "s", 1.0, 0.0)
    table.acquire("w", "s", 5.0, 0.5)
    assert table.expired(4.0) == {} and table.next_deadline() == 5.0
    assert len(table) == 1


def test_clear_drops_every_timer_of_the_workers() -> None:
    table = TimerTable()
    for scope in "abc":
        table.acquire("w1", scope, 1.0, 0.0)
    table.acquire("w2", "a", 1.0, 0.0)
    assert table.clear({"w1"}) == 3
    assert list(table.expired(2.0)) == ["w2"]


def test_released_entries_do_not_pile_up() -> None:
    table = TimerTable()
    for i in range(10_000):
        table.acquire("w", "s", float(i), 0.0)
        table.release("w", "s")
    assert len(table._heap) <= 64 + 4


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from("xyz"), st.floats(0, 100), st.booleans()),
        max_size=60,
    ),
    st.floats(0, 100),
)
def test_expired_matches_a_plain_model(ops: list[tuple[str, str, float, bool]], now: float) -> None:
    table, model = TimerTable(), {}
    for worker, scope, deadline, release in ops:
        if release:
            table.release(worker, scope)
            model.pop((worker, scope), None)
        else:
            table.acquire(worker, scope, deadline, 0.0)
            model[(worker, scope)] = deadline
    expected = sorted(key for key, deadline in model.items() if deadline <= now)
    got = sorted((w, t.scope) for w, ts in table.expired(now).items() for t in ts)
    assert got == expected
    rest = [deadline for deadline in model.values() if deadline > now]
    assert table.next_deadline() == (min(rest) if rest else None)


def test_silent_names_the_hung_and_the_next_moment_to_look() -> None:
    assert silent({0: 0.0, 1: 5.0, 2: 8.0}, now=10.0, timeout=5.0) == ([0, 1], 13.0)
    assert silent({}, now=1.0, timeout=1.0) == ([], None)


def test_faulthandler_dump_is_cut_from_the_stderr_tail() -> None:
    stderr = 'noise\nFatal Python error: Aborted\n\nThread 0x1:\n  File "x.py", line 3\n'
    assert faulthandler_dump(stderr).startswith("Fatal Python error: Aborted\n\nThread")
    assert faulthandler_dump("no dump here") == ""
    long = "Fatal Python error: Aborted\n" + "line\n" * 500
    assert faulthandler_dump(long, max_lines=10).endswith("(491 more lines in the log)")


def test_requests_on_the_pipe_are_validated() -> None:
    good = FileTimerRequest(12, "step", 1.5, 9, acquired_at=1.0)
    assert parse_request(good.to_json().encode()) == good
    assert parse_request(good.to_json().encode()).signal == 9
    assert parse_request(good.to_json().encode()).acquired_at == 1.0
    for line, reason in [
        (b"garbage", "not JSON"),
        (b"[1]", "not a JSON object"),
        (json.dumps({"pid": 0, "scope_id": "s", "expiration_time": 1}).encode(), "pid 0"),
        (json.dumps({"pid": "1", "scope_id": "s", "expiration_time": 1}).encode(), "pid '1'"),
        (json.dumps({"pid": 1, "scope_id": 3, "expiration_time": 1}).encode(), "scope_id 3"),
        (json.dumps({"pid": 1, "scope_id": "s", "expiration_time": "x"}).encode(), "'x'"),
        (b'{"pid": 1, "scope_id": "s", "expiration_time": NaN}', "nan"),
        (
            json.dumps({"pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 999}).encode(),
            "signal 999",
        ),
        (
            json.dumps({"version": 7, "pid": 1, "scope_id": "s", "expiration_time": 1}).encode(),
            "protocol version 7",
        ),
        (
            json.dumps(
                {"pid": 1, "scope_id": "s", "expiration_time": 1, "acquired_at": "x"}
            ).encode(),
            "acquired_at 'x'",
        ),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_request(line)


class Recording(TimerClient):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id, -1))


def test_expires_acquires_then_releases_even_on_error() -> None:
    client = Recording()
    with pytest.raises(KeyError), expires(after=5, scope="s", client=client):
        raise KeyError
    assert [(op, scope) for op, scope, _ in client.calls] == [("acquire", "s"), ("release", "s")]


def test_expires_names_its_scope_after_the_caller() -> None:
    client = Recording()
    with expires(after=1, client=client):
        line = __import__("sys")._getframe().f_lineno - 1
    assert client.calls[0][1] == f"{__file__}#{line}"


@pytest.mark.parametrize("after", [0, -1, math.inf, math.nan, True, "5"])
def test_expires_refuses_a_duration_that_is_not_positive(after: object) -> None:
    with (
        pytest.raises(ValueError, match="expected a positive number of seconds"),
        expires(
            after=after,
            client=Recording(),  # type: ignore[arg-type]
        ),
    ):
        pass


def test_expires_without_a_client_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import relaunch.timer.api as api

    monkeypatch.setattr(api, "_client", None)
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    with pytest.raises(RuntimeError, match="relaunch --timers"), expires(after=1):
        pass


def test_timer_requests_compare_by_value() -> None:
    assert TimerRequest(1, "s", 2.0) == TimerRequest(1, "s", 2.0)
    assert TimerRequest(1, "s", 2.0) != TimerRequest(1, "s", -1)
    assert len({TimerRequest(1, "s", 2.0), TimerRequest(1, "s", 2.0)}) == 1
