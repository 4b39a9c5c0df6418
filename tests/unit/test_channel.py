"""The worker channel carries what the workers tell their agent besides progress and liveness:
each rank's count of saves (woken with ``SAVED`` on the wake FIFO) and its learned bounds (two
copies, the older left whole while the newer is written)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest

from relaunch import worker
from relaunch.agent.channel import Channel
from relaunch.core import channel as layout
from relaunch.core.sections import Learned, Learner


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time given"
        time.sleep(0.01)


def test_learned_bounds_read_back_from_the_newer_whole_copy() -> None:
    buffer = bytearray(layout.size(2))
    at = layout.learned_offsets(2, 1)
    assert layout.read_learned(buffer, at) == b""  # none written
    assert layout.write_learned(buffer, at, b"first")
    assert layout.read_learned(buffer, at) == b"first"
    assert layout.write_learned(buffer, at, b"second")
    assert layout.read_learned(buffer, at) == b"second"
    buffer[at[0] + 8 + 16 * buffer[at[0]]] |= 1  # a writer died midway through it: odd
    assert layout.read_learned(buffer, at) == b"first"
    assert not layout.write_learned(buffer, at, b"x" * (layout.COPY + 1))  # too large: nothing
    assert layout.read_learned(buffer, at) == b"first"
    assert layout.read_learned(buffer, layout.learned_offsets(2, 0)) == b""  # the other rank


class Agent(NamedTuple):
    channel: Channel
    told: list[dict[int, int]]  # the saves it was told of
    spoke: threading.Event  # a first use of the channel


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    """A channel of two ranks, this process its local rank 1."""
    spoke = threading.Event()
    opened = Channel(2, on_first_use=spoke.set)
    told: list[dict[int, int]] = []
    opened.saves_to(told.append)
    monkeypatch.setenv(layout.CHANNEL_ENV, opened.path)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(worker._Live, "durations", {})
    worker._forget()
    yield Agent(opened, told, spoke)
    worker._forget()
    opened.close()


def test_saves_are_counted_through_the_channel(agent: Agent) -> None:
    def counted() -> int:
        return sum(count for new in agent.told for count in new.values())

    worker.note_saved()
    worker.note_saved()
    wait_until(lambda: counted() == 2)
    assert {rank for new in agent.told for rank in new} == {1}
    assert not agent.spoke.is_set()  # a save is no first use
    agent.channel.reset()  # a new attempt: the counts start again, none lost or counted twice
    worker.note_saved()
    wait_until(lambda: counted() == 3)
    worker.report_progress(1)
    wait_until(agent.spoke.is_set)


def test_a_workers_learned_bounds_reach_its_agent(agent: Agent) -> None:
    assert worker._open() is not None
    with worker._live_lock:
        for _ in range(5):
            worker._Live.durations.setdefault("step", Learner()).observe(2.0)
        worker._keep_learned()
    assert agent.channel.learned() == Learned({"step": (5, 2.0)})
    agent.channel.reset()  # the job's: kept across attempts
    assert agent.channel.learned() == Learned({"step": (5, 2.0)})


def test_the_time_in_each_section_reaches_its_agent(agent: Agent) -> None:
    """Each section name's seconds and runs, in its own entry; only the first ``TIMES`` names
    get one; after the agent empties the slots (a new attempt) the next run writes it again."""
    for name in ("data", "compute", "compute"):
        with worker.section(name):
            pass
    times = agent.channel.section_times(1)
    assert list(times) == ["data", "compute"]
    assert times["compute"][1] == 2 and times["data"][1] == 1
    assert 0 <= times["compute"][0] < 1.0
    assert agent.channel.section_times(0) == {}  # the other rank
    for extra in range(layout.TIMES):
        with worker.section(f"extra{extra}"):
            pass
    assert len(agent.channel.section_times(1)) == layout.TIMES
    with pytest.raises(KeyError), worker.section("compute"):
        raise KeyError  # a section that did not end normally counts for nothing
    assert agent.channel.section_times(1)["compute"][1] == 2
    agent.channel.reset()
    assert agent.channel.section_times(1) == {}
    with worker.section("compute"):
        pass
    assert agent.channel.section_times(1) == {
        "compute": (pytest.approx(times["compute"][0], abs=0.5), 3)
    }
