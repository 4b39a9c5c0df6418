"""The node snapshot and the agent's sinks, as tables: what each rank's sample says, when the
sampler reads the ranks anew and when it shares the tick's snapshot, and what each sink writes
for each run event (the event log's records, torchelastic's metric puts, the log line, the
Prometheus counters, the status posts' reasons), on a manual clock."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from relaunch.agent.expiry import ExpiryWatch
from relaunch.agent.metrics import AgentMetrics
from relaunch.agent.report import NodeBar, RunReport, finished
from relaunch.agent.sampler import Sampler, sample
from relaunch.agent.sinks import LogSink, MetricPuts, Sinks
from relaunch.agent.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState
from relaunch.agent.status import Group, NodeReporter
from relaunch.core.output import metrics as core_metrics
from relaunch.core.run.run_events import (
    AttemptEnded,
    Failed,
    Finished,
    Hung,
    Joined,
    NodeSnapshot,
    RankSample,
    Restarted,
    RunEvent,
    Started,
    StragglerFlagged,
)
from relaunch.core.workers.liveness import Liveness
from relaunch.core.workers.progress import Progress
from relaunch.core.workers.stragglers import SlowNode
from relaunch.events import Metrics
from relaunch.procs.context import RunProcsResult
from relaunch.procs.errors import ProcessFailure
from relaunch.rendezvous.api import RendezvousHandler, RendezvousInfo
from relaunch.runtime import ManualClock

NPROCS = 2


def progress(step: int, at: float = 100.0) -> Progress:
    return Progress(step, 10, at, "train", step + 1)


def liveness(beat_at: float = 0.0, entered: float = 0.0, beat_due: float = 0.0) -> Liveness:
    return Liveness(beat_at, beat_due, "", entered, 0.0, 0, 1 if beat_at else 0, "", "given")


# -- the snapshot --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample_", "state", "last_sign"),
    [
        (RankSample(), "running", None),
        (RankSample(progress(3, at=50.0)), "running", 50.0),
        (RankSample(progress(3, at=50.0), liveness(beat_at=70.0)), "running", 70.0),
        (RankSample(None, liveness(entered=40.0)), "running", 40.0),
        (RankSample(outcome="exited"), "ended", None),
        (RankSample(outcome="succeeded", exitcode=0), "exited with code 0", None),
        (RankSample(outcome="failed", exitcode=3), "exited with code 3", None),
        (RankSample(outcome="stopped", exitcode=-15), "killed by SIGTERM (signal 15)", None),
    ],
)
def test_a_rank_sample_says_how_the_rank_stands(sample_: RankSample, state, last_sign) -> None:
    assert sample_.running == (sample_.outcome == "running")
    assert sample_.state == state
    assert sample_.last_sign == last_sign


def test_a_snapshot_reads_as_the_channel_does() -> None:
    snapshot = NodeSnapshot(
        1.0,
        {0: RankSample(progress(4)), 1: RankSample(None, liveness(beat_at=9.0), "exited")},
    )
    assert snapshot.slots == 2
    assert snapshot.progress(0) == progress(4) and snapshot.progress(1) is None
    assert snapshot.liveness(1) == liveness(beat_at=9.0) and snapshot.liveness(0) is None
    assert snapshot.progresses() == {0: progress(4), 1: None}
    assert snapshot.running() == {0}
    assert snapshot.rank(7) == RankSample()  # a rank it has not seen: running, silent


def channel(reports: dict[int, Progress | None]) -> SimpleNamespace:
    """The channel's reads, from ``reports`` (no liveness)."""
    return SimpleNamespace(
        slots=len(reports),
        progress=reports.get,
        liveness=lambda rank: None,
        section_times=lambda rank: {},
    )


ENDED = RunProcsResult(
    failures={1: ProcessFailure(1, 11, 3, "")},
    stopped={0: -15},
    exitcodes={0: -15, 1: 3},
)


@pytest.mark.parametrize(
    ("running", "pids", "ended", "outcomes"),
    [
        (None, None, None, [("running", None), ("running", None)]),  # no attempt yet
        ({0, 1}, {0: 10, 1: 11}, None, [("running", None), ("running", None)]),
        ({0}, {0: 10, 1: 11}, None, [("running", None), ("exited", None)]),  # end not read yet
        (set(), {0: 10, 1: 11}, ENDED, [("stopped", -15), ("failed", 3)]),
        (
            set(),
            {0: 10, 1: 11},
            RunProcsResult(exitcodes={0: 0, 1: 0}),
            [("succeeded", 0), ("succeeded", 0)],
        ),
        ({1}, {1: 11}, None, [("running", None), ("running", None)]),  # rank 0 has no process
    ],
)
def test_sampling_says_how_each_process_stands(running, pids, ended, outcomes) -> None:
    snapshot = sample(channel({0: progress(1), 1: None}), 5.0, running, pids, ended)  # type: ignore[arg-type]
    assert snapshot.taken_at == 5.0
    assert [(s.outcome, s.exitcode) for s in snapshot.ranks.values()] == outcomes
    assert snapshot.progress(0) == progress(1)


class Context:
    """The reads the sampler makes of a ``PContext``; ``wait`` is the loop's alone."""

    def __init__(self) -> None:
        self.ranks_running = set(range(NPROCS))

    def running(self) -> set[int]:
        return set(self.ranks_running)

    def pids(self) -> dict[int, int]:
        return {rank: 100 + rank for rank in range(NPROCS)}

    def wait(self, timeout: float = -1) -> RunProcsResult | None:
        raise AssertionError("the sampler never asks for the group's end")


def test_readers_within_a_tick_share_one_snapshot_and_decisions_read_anew() -> None:
    clock = ManualClock()
    reports: dict[int, Progress | None] = {0: progress(1), 1: None}
    sampler = Sampler(clock, tick=0.1)
    assert sampler.latest().ranks == {}  # no attempt yet
    context = Context()
    sampler.watch(channel(reports), context)  # type: ignore[arg-type]
    first = sampler.latest()
    reports[0] = progress(2)
    clock.advance(0.05)
    assert sampler.latest() is first  # the same tick: the same numbers for every reader
    taken = sampler.take()  # the loop decides on what is there now, and publishes it
    assert taken.progress(0) == progress(2) and taken is not first
    assert sampler.latest() is taken
    reports[0] = progress(3)
    clock.advance(0.1)
    assert sampler.latest().progress(0) == progress(3)  # the next tick reads anew
    context.ranks_running = {0}
    sampler.observed(None)  # the group still runs
    assert sampler.take().rank(1).outcome == "exited"
    context.ranks_running = set()
    sampler.observed(ENDED)
    assert [s.outcome for s in sampler.take().ranks.values()] == ["stopped", "failed"]


def test_a_closed_channel_leaves_the_last_snapshot() -> None:
    def closed(rank: int) -> Progress | None:
        raise ValueError("mmap closed or invalid")

    sampler = Sampler(ManualClock(), tick=0.0)
    reports: dict[int, Progress | None] = {0: progress(5)}
    sampler.watch(channel(reports), Context())  # type: ignore[arg-type]
    last = sampler.take()
    sampler.watch(SimpleNamespace(slots=1, progress=closed, liveness=closed), Context())  # type: ignore[arg-type]
    assert sampler.take() is last and sampler.latest() is last


def test_hang_detection_reads_the_snapshot_on_its_clock() -> None:
    clock = ManualClock()
    watch = ExpiryWatch("run", timers=False, hang_timeout=None, clock=clock)
    due = clock.time() + 2.0
    lives = {0: liveness(beat_at=clock.time(), beat_due=due)}

    def snapshot() -> NodeSnapshot:
        return NodeSnapshot(clock.time(), {0: RankSample(None, lives[0])})

    watch.watch({0: 4_000_000}, {0: []}, snapshot)  # no such pid: never signalled
    assert watch.check() == pytest.approx(0.5)  # heartbeats used: the channel is looked at again
    clock.advance(2.0)
    watch.check()
    assert watch.hang is not None and "no heartbeat for 2.0s" in watch.hang


def test_the_node_bar_draws_the_ticks_snapshot() -> None:
    clock = ManualClock()
    snapshot = NodeSnapshot(clock.time(), {0: RankSample(progress(4)), 1: RankSample(progress(2))})
    bar = NodeBar(joined_group(), lambda: snapshot, clock=clock)
    assert bar() == {}  # no group started
    bar.restart()
    clock.advance(65.0)
    assert bar() == {
        "node": b"[trainer node 0]:train:  20%|####                | 2/10 "
        b"[01:05<?, ?] slowest: local rank 1".replace(b"#", "\u2588".encode())
    }


# -- the sinks -----------------------------------------------------------------------------------


class Handler(RendezvousHandler):
    identity = "host-a"

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=29500,
            rank_offset=0,
            global_world_size=NPROCS,
        )

    def get_backend(self) -> str:
        return "fake"

    def get_run_id(self) -> str:
        return "unit"


def spec() -> WorkerSpec:
    return WorkerSpec(
        role="trainer", local_world_size=NPROCS, rdzv_handler=Handler(), entrypoint="/bin/true"
    )


class Recorder:
    """An event handler and a metric handler that keep what they are given."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.metrics: list[str] = []

    def record(self, event) -> None:
        self.events.append(json.loads(event.serialize()))

    def emit(self, metric_data) -> None:
        self.metrics.append(f"[{metric_data.group_name}].{metric_data.name}={metric_data.value}")

    def close(self) -> None:
        pass


def joined_group() -> WorkerGroup:
    group = WorkerGroup(spec())
    group.join(group.spec.rdzv_handler.next_rendezvous())
    return group


def report_for(recorder: Recorder, clock: ManualClock) -> RunReport:
    return RunReport(joined_group(), recorder, "/logs/run", clock)


STRAGGLER = SlowNode("host1", 1, [1], "compute", 0.5, 0.1, 1.5)
RESTART = Restarted("trainer", "worker_failed", "rank 1 exited with code 3", "worker failed", 0, 2)
EVICTION_LINE = "node h/b (node 1, ranks 2-3) evicted as a straggler (...) for 3 s"
EVICTION = Restarted("trainer", "member_evicted", EVICTION_LINE, EVICTION_LINE, 0, 0)
ENDING = finished(
    joined_group(),
    RunResult(
        WorkerState.FAILED,
        failures={1: ProcessFailure(1, 11, 3, "", message="ValueError: boom")},
        stopped=[0],
    ),
    1,
)

#: Each run event, and the events the run report records for it: (name's state, source, error).
EVENTS: list[tuple[RunEvent, list[tuple[str, str, str | None]]]] = [
    (Joined(0.25), []),
    (Started(0, 0.25), [("HEALTHY", "AGENT", None)]),
    (AttemptEnded("trainer", "FAILED", 2), []),
    (RESTART, [("RESTARTING", "AGENT", "rank 1 exited with code 3")]),
    (EVICTION, [("RESTARTING", "AGENT", EVICTION_LINE), ("EVICTED", "AGENT", EVICTION_LINE)]),
    (Hung(1, "local rank 0 is hung"), [("HUNG", "AGENT", "local rank 0 is hung")]),
    (StragglerFlagged(STRAGGLER, 1), [("STRAGGLER", "WORKER", None)]),
    (Failed(1, "boom"), [("FAILED", "AGENT", "boom")]),
    (Failed(1), [("FAILED", "AGENT", None)]),
    (
        ENDING,
        [
            ("STOPPED", "WORKER", None),
            ("FAILED", "WORKER", '{"message": "ValueError: boom"}'),
            ("FAILED", "AGENT", None),
        ],
    ),
]


@pytest.mark.parametrize(("run_event", "expected"), EVENTS)
def test_the_run_report_records_each_run_event(run_event: RunEvent, expected) -> None:
    recorder, clock = Recorder(), ManualClock()
    report = report_for(recorder, clock)
    clock.advance(12.5)
    report.on_run_event(run_event)
    got = [
        (e["name"].rsplit(".", 1)[1], e["source"], e["metadata"]["raw_error"])
        for e in recorder.events
    ]
    assert got == expected
    for event in recorder.events:
        assert event["metadata"]["total_run_time"] == 12
        assert json.loads(event["metadata"]["metadata"])["time"] == round(clock.time(), 3)
    summary = report.summary("failed")
    assert summary.restarts == (["rank 1 exited with code 3"] if run_event is RESTART else [])
    assert summary.evictions == ([EVICTION_LINE] if run_event is EVICTION else [])
    assert summary.stragglers == ([STRAGGLER.describe()] if "STRAGGLER" in str(got) else [])


def test_the_run_reports_events_carry_what_torchelastic_and_relaunch_write() -> None:
    recorder, clock = Recorder(), ManualClock()
    report = report_for(recorder, clock)
    report.last_progress = {0: progress(7)}
    for run_event in (Started(0, 0.25), RESTART, StragglerFlagged(STRAGGLER, 1), ENDING):
        report.on_run_event(run_event)
    started, restarting, straggler, stopped, *_ = (
        json.loads(e["metadata"]["metadata"]) for e in recorder.events
    )
    assert started["rendezvous_seconds"] == 0.25
    assert restarting["cause"] == "worker_failed"
    assert straggler["straggler"] == {
        "node": "host1",
        "node_rank": 1,
        "ranks": [1],
        "section": "compute",
        "value": 0.5,
        "median": 0.1,
        "factor": 1.5,
    }
    assert stopped["progress"] == {"step": 7, "total": 10, "desc": "train"}
    assert stopped["local_rank"] == [0] and stopped["role_rank"] == [0]


#: Each run event, and torchelastic's metric puts for it.
PUTS: list[tuple[RunEvent, list[str]]] = [
    (
        AttemptEnded("trainer", "FAILED", 2),
        [
            "[torchelastic].workers.trainer.remaining_restarts=2",
            "[torchelastic].workers.trainer.failed=1",
        ],
    ),
    (
        AttemptEnded("trainer", "RUNNING", 0),
        [
            "[torchelastic].workers.trainer.remaining_restarts=0",
            "[torchelastic].workers.trainer.running=1",
        ],
    ),
    (RESTART, []),
    (Started(0, 0.1), []),
    (ENDING, []),
]


@pytest.mark.parametrize(("run_event", "expected"), PUTS)
def test_the_metric_puts_are_torchelastics(run_event: RunEvent, expected) -> None:
    recorder = Recorder()
    MetricPuts(Metrics(recorder, group="torchelastic", clock=ManualClock())).on_run_event(run_event)
    assert recorder.metrics == expected


#: Each run event, and the log lines said for it.
LINES: list[tuple[RunEvent, list[str]]] = [
    (RESTART, ["[trainer] restarting the worker group (worker failed); 2 restart(s) left"]),
    # An eviction spends no restart: no count of the restarts left, which it did not touch.
    (EVICTION, [f"[trainer] {EVICTION_LINE}; no restart spent"]),
    (AttemptEnded("trainer", "FAILED", 2), []),
    (Hung(0, "local rank 0 is hung"), []),  # the hang detection says it, with more
    (StragglerFlagged(STRAGGLER, 0), []),  # the reporter that found it says it
]


@pytest.mark.parametrize(("run_event", "expected"), LINES)
def test_the_log_says_a_restart(run_event: RunEvent, expected, caplog) -> None:
    caplog.set_level(logging.INFO, logger="relaunch.test")
    LogSink(logging.getLogger("relaunch.test")).on_run_event(run_event)
    assert [r.getMessage() for r in caplog.records] == expected


def test_prometheus_counts_restarts_and_joins() -> None:
    reporter = NodeReporter(1.5)
    exporter = AgentMetrics(
        joined_group(), reporter, lambda: NodeSnapshot(0.0), lambda: 0, ManualClock()
    )
    for run_event in (Joined(0.3), RESTART, Joined(2.0), Hung(0, "x"), Started(0, 0.3)):
        exporter.on_run_event(run_event)
    families = {family.name: family for family in exporter.families(0.0)}
    restarts = {
        dict(s.labels)["cause"]: s.value for s in families["relaunch_group_restarts_total"].samples
    }
    assert restarts["worker_failed"] == 1 and sum(restarts.values()) == 1
    assert [s.value for s in families["relaunch_rendezvous_rounds_total"].samples] == [2]
    assert set(core_metrics.CATALOGUE) == set(families)


def test_the_status_posts_tell_the_restarts_reasons() -> None:
    clock = ManualClock()
    reporter = NodeReporter(1.5, restarts_used=lambda: 3, clock=clock)
    snapshot = NodeSnapshot(clock.time(), {0: RankSample(progress(2), None, "failed", 3)})
    reporter.start(Group("host-a", 0, 1, {0: 4}, lambda: snapshot), None)
    reporter.stop()
    reporter.on_run_event(RESTART)
    reporter.on_run_event(Started(1, 0.1))
    status = reporter.status()
    assert status is not None
    assert status.restarts == 3 and status.restart_reasons == ["rank 1 exited with code 3"]
    assert status.posted_at == clock.time()
    (rank,) = status.ranks
    assert (rank.rank, rank.state, rank.step, rank.last_sign) == (4, "exited with code 3", 2, 100.0)


def test_the_sinks_are_told_in_order() -> None:
    told: list[tuple[str, RunEvent]] = []

    class Sink:
        def __init__(self, name: str) -> None:
            self.name = name

        def on_run_event(self, run_event: RunEvent) -> None:
            told.append((self.name, run_event))

    Sinks([Sink("report"), Sink("log")]).on_run_event(RESTART)
    assert told == [("report", RESTART), ("log", RESTART)]


def test_the_runs_end_tells_how_each_worker_ended() -> None:
    assert isinstance(ENDING, Finished)
    assert (ENDING.state, ENDING.restart_count) == ("FAILED", 1)
    assert [(w.global_rank, w.state, w.error) for w in ENDING.workers] == [
        (0, "STOPPED", None),
        (1, "FAILED", '{"message": "ValueError: boom"}'),
    ]
