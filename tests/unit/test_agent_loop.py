"""The agent's run loop with a fake process context: no worker process is started here.

The fake context says when the group ends; the fake rendezvous handler says when membership
changes. The loop must sleep until one of them (or a signal, or a deadline) wakes it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import wait_until

from relaunch.agent import LocalElasticAgent, WorkerSpec, WorkerState
from relaunch.agent.state import AGREE_TRIES
from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.core.sections import Learned
from relaunch.events import Event, EventHandler
from relaunch.procs.context import RunProcsResult
from relaunch.procs.errors import ProcessFailure, SignalException
from relaunch.procs.signals import raise_signal_exception
from relaunch.rendezvous.api import JobFailedError, RendezvousHandler, RendezvousInfo
from relaunch.rendezvous.job import SoloJob

pytestmark = pytest.mark.timeout(30)

NPROCS = 2


class NoGuardian:
    """The channel's directory would be registered with the guardian process: none is started
    here."""

    def register_file(self, path: str) -> None:
        pass

    def unregister_file(self, path: str) -> None:
        pass


@pytest.fixture(autouse=True)
def no_guardian(monkeypatch) -> None:
    monkeypatch.setattr("relaunch.agent.shm.guardian", NoGuardian)


class FakeContext:
    """Stands in for a ``PContext``: the test ends the group with ``end``, from any thread."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.stdouts = dict.fromkeys(range(NPROCS), "")
        self.stderrs = dict.fromkeys(range(NPROCS), "")
        self.looks = 0  # how often the agent asked how the group stands
        self.closed_with: signal.Signals | None = None
        self._lock = threading.Lock()
        self._result: RunProcsResult | None = None
        self._callbacks: list[Callable[[], None]] = []

    def pids(self) -> dict[int, int]:
        return {rank: 1_000_000 + rank for rank in range(NPROCS)}

    def running(self) -> set[int]:
        return set() if self._result else set(range(NPROCS))

    def wait(self, timeout: float = -1) -> RunProcsResult | None:
        assert timeout == 0, "the loop never blocks in the context"
        self.looks += 1
        return self._result

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._result is None:
                self._callbacks.append(fn)
                return
        fn()

    def end(self, result: RunProcsResult) -> None:
        with self._lock:
            self._result, callbacks = result, self._callbacks
            self._callbacks = []
        for fn in callbacks:
            fn()

    def close(self, death_sig: signal.Signals | None = None, timeout: float = 0) -> None:
        self.closed_with = death_sig
        if self._result is None:
            self.end(RunProcsResult(stopped=dict.fromkeys(range(NPROCS), -int(death_sig or 15))))


def succeeded() -> RunProcsResult:
    return RunProcsResult(return_values={rank: f"value {rank}" for rank in range(NPROCS)})


def failed() -> RunProcsResult:
    failure = ProcessFailure(1, 1_000_001, 3, "", message="ValueError: boom")
    return RunProcsResult(failures={1: failure}, stopped={0: -15})


class Starter:
    """The agent's ``start_processes``: each attempt gets a ``FakeContext``, then ``script``."""

    def __init__(self, *scripts: Callable[[FakeContext], None]) -> None:
        self.scripts = list(scripts)
        self.contexts: list[FakeContext] = []
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> FakeContext:
        self.calls.append(kwargs)
        context = FakeContext(kwargs["log_dir"])
        self.contexts.append(context)
        self.scripts.pop(0)(context)
        return context


def ends_with(result: Callable[[], RunProcsResult]) -> Callable[[FakeContext], None]:
    return lambda context: context.end(result())


def keeps_running(context: FakeContext) -> None:
    pass


class Handler(RendezvousHandler, SoloJob):
    """This node (group rank 0) of ``nodes``, membership the test changes with ``announce``; no
    listener support. It is its own ``job``: the job services not written here are a solo
    job's."""

    def __init__(self, watching: bool = True, grace: float = 0.0, nodes: int = 1) -> None:
        SoloJob.__init__(self, self)
        self.job = self
        self.change: MembershipChange | None = None
        self.listener: Callable[[MembershipChange], None] | None = None
        self.asked = 0
        self.rounds = 0
        self.notes: list[str] = []
        self.closed = False
        self._watching = watching
        self._grace = grace
        self._nodes = nodes

    def next_rendezvous(self) -> RendezvousInfo:
        self.rounds += 1
        self.change = None
        return RendezvousInfo(
            group_rank=0,
            group_world_size=self._nodes,
            master_addr="127.0.0.1",
            master_port=29500,
            rank_offset=0,
            global_world_size=NPROCS * self._nodes,
        )

    def get_backend(self) -> str:
        return "fake"

    def get_run_id(self) -> str:
        return "unit"

    @property
    def watches_membership(self) -> bool:
        return self._watching

    @property
    def lost_node_grace(self) -> float:
        return self._grace

    def membership_change(self) -> MembershipChange | None:
        self.asked += 1
        return self.change

    def announce(self, change: MembershipChange) -> None:
        self.change = change
        if self.listener is not None:
            self.listener(change)

    def note_restart(self, reason: str) -> None:
        self.notes.append(reason)

    def set_closed(self) -> None:
        self.closed = True


class ListeningHandler(Handler):
    pushes_changes = True

    def leave_death_notice_with(self, send: Callable[[str | None], None]) -> None:
        pass

    def share_learned(self, learned: Learned) -> Learned:
        return learned

    def set_change_listener(self, listener: Callable[[MembershipChange], None] | None) -> None:
        self.listener = listener


def agent_for(
    tmp_path,
    handler: Handler,
    starter: Starter,
    max_restarts: int = 0,
    interval: float = 0.1,
    event_handler: EventHandler | None = None,
) -> LocalElasticAgent:
    spec = WorkerSpec(
        role="trainer",
        local_world_size=NPROCS,
        rdzv_handler=handler,
        entrypoint="/bin/true",
        max_restarts=max_restarts,
        monitor_interval=interval,
    )
    return LocalElasticAgent(
        spec, log_dir=str(tmp_path), start_processes=starter, event_handler=event_handler
    )


def in_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def attempt_dirs(agent: LocalElasticAgent) -> list[str]:
    return sorted(os.listdir(agent.log_dir))


def test_a_group_that_ends_at_once_succeeds_and_is_closed(tmp_path) -> None:
    handler = ListeningHandler()
    starter = Starter(ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter)
    result = agent.run()
    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: "value 0", 1: "value 1"}
    assert handler.closed and handler.listener is None
    (context,) = starter.contexts
    assert context.closed_with is signal.SIGTERM
    assert starter.calls[0]["log_dir"].endswith("attempt_0")


def test_an_idle_loop_sleeps_until_the_group_ends(tmp_path) -> None:
    handler = ListeningHandler()
    started = threading.Event()
    starter = Starter(lambda context: started.set())
    agent = agent_for(tmp_path, handler, starter, interval=0.01)

    def end_later() -> None:
        started.wait(10)
        wait_until(lambda: starter.contexts[0].looks >= 1, what="the agent's first look")
        threading.Event().wait(0.3)  # idle time: a polling loop would look about 30 times
        starter.contexts[0].end(succeeded())

    ender = in_thread(end_later)
    assert agent.run().state is WorkerState.SUCCEEDED
    ender.join(10)
    # Before sleeping, when woken by the end, and for the result once it was closed.
    assert starter.contexts[0].looks == 3
    assert handler.asked <= 2


def test_a_failure_uses_a_restart_and_tells_the_other_nodes_why(tmp_path) -> None:
    handler = ListeningHandler()
    starter = Starter(ends_with(failed), ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter, max_restarts=2)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert agent.restart_count == 1 and handler.rounds == 2
    assert attempt_dirs(agent) == ["attempt_0", "attempt_1"]
    assert len(handler.notes) == 1 and "rank 1 exited with code 3" in handler.notes[0]
    assert "ValueError: boom" in handler.notes[0]
    assert agent.summary("succeeded").restarts == [handler.notes[0].split(": ", 1)[1]]


def test_a_membership_change_restarts_the_group_for_free(tmp_path) -> None:
    handler = ListeningHandler()
    starter = Starter(keeps_running, ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter, interval=60)

    def announce() -> None:
        wait_until(lambda: starter.contexts and starter.contexts[0].looks >= 1)
        handler.announce(MembershipChange.nodes_waiting(1))

    in_thread(announce)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert starter.contexts[0].closed_with is signal.SIGTERM
    assert agent.restart_count == 0 and handler.notes == []
    assert attempt_dirs(agent) == ["attempt_0", "attempt_0.1"]
    assert agent.summary("succeeded").restarts == ["1 node(s) waiting to join"]


def test_a_handler_without_a_listener_is_asked_every_monitor_interval(tmp_path) -> None:
    handler = Handler()
    starter = Starter(keeps_running, ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter, interval=0.01)

    def change() -> None:
        wait_until(lambda: starter.contexts and starter.contexts[0].looks >= 1)
        # nobody is told: only polling finds it
        handler.change = MembershipChange.member_lost(1, "silent", detected_by=0)

    in_thread(change)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert handler.rounds == 2 and agent.restart_count == 0


def test_a_failure_without_restarts_waits_for_a_lost_node_to_be_noticed(tmp_path) -> None:
    handler = ListeningHandler(grace=60, nodes=2)
    starter = Starter(ends_with(failed), ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter)

    def lose_a_node() -> None:
        wait_until(lambda: handler.asked >= 1, what="the failure to be seen")
        handler.announce(MembershipChange.member_lost(1, "no heartbeat for 30s", 0))

    in_thread(lose_a_node)
    started = time.monotonic()
    assert agent.run().state is WorkerState.SUCCEEDED
    assert time.monotonic() - started < 30  # woken by the change, not by the end of the grace
    assert agent.restart_count == 0 and handler.notes == []


def test_a_failure_without_restarts_fails_once_the_grace_has_passed(tmp_path) -> None:
    handler = ListeningHandler(grace=0.3, nodes=2)
    starter = Starter(ends_with(failed))
    agent = agent_for(tmp_path, handler, starter, interval=0.01)
    started = time.monotonic()
    result = agent.run()
    assert time.monotonic() - started >= 0.3
    assert result.state is WorkerState.FAILED
    assert set(result.failures) == {1} and result.stopped == [0]
    assert starter.contexts[0].looks <= 4  # it slept through the grace, it did not poll
    assert result.failures[1].message == "ValueError: boom"  # explained once, not per look


class SharedCountHandler(ListeningHandler):
    """A node of a job whose restarts are counted elsewhere (``used``), whose peers answer a
    presence check with ``alive``; what it is told to end the job with goes to ``failed_with``."""

    def __init__(self, used: int = 0, alive: bool | None = None, nodes: int = 2) -> None:
        super().__init__(grace=60, nodes=nodes)
        self.used, self.alive = used, alive
        self.calls = 0
        self.failed_with: list[str] = []

    def restarts_used(self, spent_here: int) -> int:
        return self.used

    def peers_alive(self, timeout: float) -> bool | None:
        self.calls += 1
        return self.alive

    def fail_job(self, reason: str, stacks: bool = False, requeue: bool = True) -> None:
        self.failed_with.append(reason)
        self.closed = True


def test_the_budget_is_the_jobs_as_the_handler_counts_it(tmp_path) -> None:
    handler = SharedCountHandler(used=1, alive=True)
    starter = Starter(ends_with(failed), ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter, max_restarts=2)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert handler.rounds == 2 and agent.restart_count == 1  # the job's count, not this node's
    spent = SharedCountHandler(used=2, alive=True)  # other nodes spent them all
    agent = agent_for(tmp_path / "spent", spent, Starter(ends_with(failed)), max_restarts=2)
    assert agent.run().state is WorkerState.FAILED
    assert spent.rounds == 1 and spent.notes == []


def test_with_no_restart_left_a_failure_is_final_at_once_when_every_peer_answers(
    tmp_path,
) -> None:
    handler = SharedCountHandler(alive=True)
    agent = agent_for(tmp_path, handler, Starter(ends_with(failed)))
    started = time.monotonic()
    result = agent.run()
    assert time.monotonic() - started < 30  # not the grace of 60 s
    assert result.state is WorkerState.FAILED and handler.calls == 1
    (reason,) = handler.failed_with
    assert "rank 1 exited with code 3" in reason and reason.endswith("(no restart left)")


def test_with_a_peer_silent_at_the_presence_check_the_grace_is_waited(tmp_path) -> None:
    handler = SharedCountHandler(alive=False)
    starter = Starter(ends_with(failed), ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter)

    def lose_a_node() -> None:
        wait_until(lambda: handler.calls >= 1, what="the presence check")
        handler.announce(MembershipChange.member_lost(1, "no heartbeat", 0))

    in_thread(lose_a_node)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert handler.calls == 1 and handler.failed_with == [] and agent.restart_count == 0


def test_a_failure_that_ended_the_job_elsewhere_stops_this_node_with_it(tmp_path) -> None:
    handler = SharedCountHandler()
    starter = Starter(keeps_running)
    agent = agent_for(tmp_path, handler, starter)

    def fail_elsewhere() -> None:
        wait_until(lambda: starter.contexts and starter.contexts[0].looks >= 1)
        handler.announce(MembershipChange.failed("n2: rank 3 exited with code 1"))

    in_thread(fail_elsewhere)
    with pytest.raises(JobFailedError, match="the job failed: n2: rank 3 exited with code 1"):
        agent.run()
    assert starter.contexts[0].closed_with is signal.SIGTERM
    assert handler.rounds == 1 and handler.failed_with == []


def test_in_a_group_of_one_node_a_failure_fails_at_once(tmp_path) -> None:
    handler = ListeningHandler(grace=60, nodes=1)  # no other node to lose
    starter = Starter(ends_with(failed))
    agent = agent_for(tmp_path, handler, starter)
    started = time.monotonic()
    assert agent.run().state is WorkerState.FAILED
    assert time.monotonic() - started < 30


def test_without_watched_membership_a_failure_fails_at_once(tmp_path) -> None:
    handler = Handler(watching=False, grace=60)
    starter = Starter(ends_with(failed))
    agent = agent_for(tmp_path, handler, starter)
    assert agent.run().state is WorkerState.FAILED
    assert handler.asked == 0


def test_a_signal_from_another_thread_wakes_the_sleeping_loop_at_once(tmp_path) -> None:
    handler = ListeningHandler()
    starter = Starter(keeps_running)
    agent = agent_for(tmp_path, handler, starter)
    previous_handler = signal.signal(signal.SIGUSR1, raise_signal_exception)
    sent_at: list[float] = []

    def send() -> None:
        wait_until(lambda: starter.contexts and starter.contexts[0].looks >= 1)
        sent_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGUSR1)  # may be taken by this thread: the wake-up fd tells

    try:
        in_thread(send)
        with pytest.raises(SignalException) as caught:
            agent.run()
        woke_after = time.monotonic() - sent_at[0]
    finally:
        signal.signal(signal.SIGUSR1, previous_handler)
    assert caught.value.sigval is signal.SIGUSR1
    assert woke_after < 1.0  # at once; the loop has nothing else that would wake it
    assert starter.contexts[0].closed_with is signal.SIGUSR1
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    assert wakeup_fd == -1  # the loop gave the signal wake-up fd back


class SignalsInDel:
    """Sends this process ``SIGUSR1`` when collected; the handler then runs inside ``__del__``
    (at the call after the kill), where Python drops the exception it raises."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.getpid()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_whose_exception_a_del_swallowed_still_stops_the_run(tmp_path) -> None:
    handler = ListeningHandler()
    dropped: list[SignalsInDel] = [SignalsInDel()]

    def drops_it_at_the_first_look(context: FakeContext) -> None:
        looked = context.wait

        def wait(timeout: float = -1) -> RunProcsResult | None:
            if dropped:
                dropped.clear()  # collected here: the signal's exception goes nowhere
            return looked(timeout)

        context.wait = wait  # type: ignore[method-assign]

    starter = Starter(drops_it_at_the_first_look)
    agent = agent_for(tmp_path, handler, starter)
    previous_handler = signal.signal(signal.SIGUSR1, raise_signal_exception)
    try:
        with pytest.raises(SignalException) as caught:
            agent.run()
    finally:
        signal.signal(signal.SIGUSR1, previous_handler)
    assert not dropped
    assert caught.value.sigval is signal.SIGUSR1
    assert starter.contexts[0].closed_with is signal.SIGUSR1


def test_a_worker_killed_by_a_signal_has_its_meaning_in_its_event(tmp_path) -> None:
    class Recorder:
        def __init__(self) -> None:
            self.events: list[Event] = []

        def record(self, event: Event) -> None:
            self.events.append(event)

        def close(self) -> None:
            pass

    def killed() -> RunProcsResult:
        failure = ProcessFailure(1, 1_000_001, -signal.SIGKILL, "")  # no error file, no log
        return RunProcsResult(failures={1: failure}, stopped={0: -15})

    recorder = Recorder()
    agent = agent_for(tmp_path, Handler(), Starter(ends_with(killed)), event_handler=recorder)
    assert agent.run().state is WorkerState.FAILED
    (worker,) = [e for e in recorder.events if e.metadata.get("global_rank") == 1]
    assert worker.metadata["state"] == "FAILED"
    raw = worker.metadata["raw_error"]
    assert isinstance(raw, str)
    assert json.loads(raw)["message"].startswith("SIGKILL: killed from outside")


class Disagreeing(ListeningHandler):
    """Group rank 0 of two nodes whose first ``fails`` state agreements fail (the other node's
    record never came); then both records come."""

    local_addr = "127.0.0.1"  # a node of several: its state is agreed with the others

    def __init__(self, fails: int) -> None:
        super().__init__(nodes=2)
        self.fails = fails
        self.gathers = 0

    def gather(
        self, name: str, rank: int, count: int, value: bytes, timeout: float
    ) -> dict[int, bytes] | None:
        self.gathers += 1
        return None if self.gathers <= self.fails else dict.fromkeys(range(count), value)


def test_nodes_that_cannot_agree_on_the_state_start_nothing_and_join_again(
    tmp_path, caplog
) -> None:
    handler = Disagreeing(fails=1)
    starter = Starter(ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert handler.gathers == 2 and handler.rounds == 2
    assert len(starter.calls) == 1  # no worker started before the nodes agreed
    assert agent.restart_count == 0  # the second join is free
    assert "could not agree on a step to resume from" in caplog.text
    assert "joining the rendezvous again" in caplog.text


def test_nodes_that_never_agree_start_without_state_after_their_tries(tmp_path, caplog) -> None:
    handler = Disagreeing(fails=100)
    starter = Starter(ends_with(succeeded))
    agent = agent_for(tmp_path, handler, starter)
    assert agent.run().state is WorkerState.SUCCEEDED
    assert handler.gathers == AGREE_TRIES and handler.rounds == AGREE_TRIES
    assert len(starter.calls) == 1
    assert "the workers start without state" in caplog.text
