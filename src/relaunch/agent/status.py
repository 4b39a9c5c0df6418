"""What the agent tells the rest of the job, from a thread of its own (the store may be slow to
answer; the agent loop must never wait on it).

Every ``INTERVAL`` seconds (longer in a job of more than 300 nodes:
``core.workers.stragglers.interval`` bounds the posts of the whole job to 100 a second) it posts
this node's ``NodeStatus`` as the round's note ``status/<group rank>``; the agent of group rank 0
reads every node's (one range read on etcd, one read per node on the built-in store), judges the job
(``core.output.status.job_view``: stragglers, the slowest rank, the pace) and posts it as the note
``job``, which the others read. ``relaunch status`` reads the same notes.

Each post carries its ranks' steps per second and their seconds a step in each section
(``core.workers.stragglers``). Stragglers are flagged by node (``flagged_nodes``), on the
console (every node flagged on group rank 0's, itself elsewhere) and through ``on_flag`` (the
status event and the run summary); group rank 0's console shows the job-wide bar
(``job_line``). A job of one node judges itself, without the store.

Each post reads one ``NodeSnapshot`` (``agent.sampler``), the one the console and a scrape of
the same tick read; the reporter hears of restarts as a sink (``on_run_event``) for its posts'
reasons.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from relaunch.core.defaults import MAX_SECONDS
from relaunch.core.output import status as core
from relaunch.core.run.run_events import NodeSnapshot, RestartCosted, Restarted, RunEvent
from relaunch.core.value import Value
from relaunch.core.workers import stragglers
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread

if TYPE_CHECKING:
    from relaunch.agent.eviction import Evictor

log = logging.getLogger(__name__)
_Note = TypeVar("_Note")

JOB_NOTE = "job"


def status_note(group_rank: int) -> str:
    return f"status/{group_rank}"


class Group(Value):
    """The group of workers a reporter watches: ``ranks`` maps local ranks to global ranks;
    ``snapshot()`` is the tick's view of them (``agent.sampler.Sampler.latest``)."""

    __slots__ = ("group_rank", "node", "nodes", "ranks", "snapshot")

    node: str
    group_rank: int
    nodes: int
    ranks: Mapping[int, int]
    snapshot: Callable[[], NodeSnapshot]

    def __init__(
        self,
        node: str,
        group_rank: int,
        nodes: int,
        ranks: Mapping[int, int],
        snapshot: Callable[[], NodeSnapshot],
    ) -> None:
        self._set(node=node, group_rank=group_rank, nodes=nodes, ranks=ranks, snapshot=snapshot)


class NodeReporter:
    """Posts this node's status and flags stragglers (see the module docstring).

    ``node_state()`` is the group's state and ``restarts_used()`` the job's restarts, as the
    agent knows them; ``clock`` stamps the posts and times the store."""

    def __init__(
        self,
        factor: float,
        on_flag: Callable[[stragglers.SlowNode], None] = lambda node: None,
        interval: float = stragglers.INTERVAL,
        node_state: Callable[[], str] = lambda: "HEALTHY",
        restarts_used: Callable[[], int] = lambda: 0,
        clock: Clock = SYSTEM_CLOCK,
        evict_after: float | None = None,
    ) -> None:
        self._factor = factor
        #: ``--evict-stragglers`` (None: off): the judge's decisions, every node's heed.
        self._evictor: Evictor | None = None
        if evict_after is not None:
            from relaunch.agent.eviction import Evictor  # only a launch that evicts loads it

            self._evictor = Evictor(evict_after)
        self._on_flag = on_flag
        self._interval = interval
        self._node_state = node_state
        self._restarts_used = restarts_used
        self._clock = clock
        #: Why the group restarted, restart by restart (``on_run_event``).
        self._reasons: list[str] = []
        self._lost = 0.0  # seconds lost to restarts (``core.run.goodput``)
        self._stop = threading.Event()
        self._reported = threading.Event()
        self._thread: threading.Thread | None = None
        #: The job-wide bar, on group rank 0's node of a job of several (None: none yet).
        self.job_line: str | None = None
        #: The last view of the job this node saw (its own with one node, group rank 0's
        #: otherwise; None: none yet in this group), and the seconds its last status post to
        #: the store took (None: none yet): read by ``agent.metrics``.
        self.view: core.JobView | None = None
        self.store_round_trip: float | None = None
        self._started_at = clock.time()
        self._stale_after = 2 * interval  # set by ``start``, with the group's
        # The group watched: set by ``start``, read by its thread only.
        self._group: Group | None = None
        self._job: JobServices | None = None
        self._rates = stragglers.RankRates()
        self._times = stragglers.SectionTimes()
        self._said: set[int] = set()  # the node ranks flagged at the last look

    def start(self, group: Group, job: JobServices | None) -> None:
        """Report on a new group (``job`` shares the posts; not needed by one node)."""
        self.stop()
        self._group, self._job = group, job
        self._rates, self._times, self._said = (
            stragglers.RankRates(),
            stragglers.SectionTimes(),
            set(),
        )
        self.view = None
        if self._evictor is not None:
            self._evictor.new_round()
        # A post older than the job's keep-alive detection time (or than two posts' interval)
        # no longer says how this node stands: ``relaunch status`` shows it stale.
        every = stragglers.interval(group.nodes, self._interval)
        grace = 0.0 if job is None else job.lost_node_grace
        self._stale_after = min(max(2 * every, grace), MAX_SECONDS)
        self._stop, self._reported = threading.Event(), threading.Event()
        snapshot = group.snapshot()
        if any(snapshot.progress(local) is not None for local in group.ranks):
            self._reported.set()  # a rank reported before this was called
        self._thread = start_thread(self._run, "relaunch-status", self._stop, self._reported)

    def on_run_event(self, run_event: RunEvent) -> None:
        """A sink of the agent's run events: a restart's reason and cost go into the next
        posts."""
        if isinstance(run_event, Restarted):
            self._reasons.append(run_event.reason)
        elif isinstance(run_event, RestartCosted):
            self._lost += run_event.cost.total

    def notice_reports(self) -> None:
        """A rank made its first progress report (the channel's wake): sampling is worth it."""
        self._reported.set()

    def stop(self) -> None:
        self._stop.set()
        self._reported.set()  # ends the wait for a first report
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, stop: threading.Event, reported: threading.Event) -> None:
        assert self._group is not None
        every = stragglers.interval(self._group.nodes, self._interval)
        if self._group.nodes <= 1:
            # Nobody else reads this node's posts: nothing to do until a rank reports its steps
            # (an idle launcher stays asleep).
            reported.wait()
        else:
            self.report()  # at once: ``relaunch status`` shows the group from its start
        while not stop.wait(every):
            self.report()  # what it cannot post or read it skips; a bug ends the agent

    def status(self, snapshot: NodeSnapshot | None = None) -> core.NodeStatus | None:
        """This node's status now, from ``snapshot`` (default: the tick's); None before a
        group started."""
        group = self._group
        if group is None:
            return None
        if snapshot is None:
            snapshot = group.snapshot()
        now = self._clock.time()
        rates = self._rates.rates(now)
        times = self._times.per_step()
        ranks = []
        for local, rank in sorted(group.ranks.items()):
            sample = snapshot.rank(local)
            progress = sample.progress
            ranks.append(
                core.RankStatus(
                    rank,
                    local,
                    sample.state,
                    None if progress is None else progress.step,
                    None if progress is None else progress.total,
                    rates.get(rank),
                    sample.last_sign,
                    times.get(rank),
                )
            )
        return core.NodeStatus(
            group.node,
            group.group_rank,
            self._node_state(),
            self._restarts_used(),
            now,
            ranks,
            list(self._reasons),
            round(self._lost, 3),
            round(self._stale_after, 3),
        )

    def report(self) -> None:
        """Sample the ranks, post this node's status, and judge the job (group rank 0) or read
        its verdict (the others)."""
        group, job = self._group, self._job
        if group is None:
            return
        snapshot = group.snapshot()
        for local, rank in group.ranks.items():
            sample = snapshot.rank(local)
            progress = sample.progress
            if progress is not None:
                self._rates.add(rank, progress.time, progress.step)
            step = None if progress is None else progress.step
            self._times.add(rank, snapshot.taken_at, step, sample.times)
        mine = self.status(snapshot)
        assert mine is not None
        if group.nodes <= 1 or job is None:
            view = core.job_view([mine], self._factor, mine.posted_at)
            self.view = view
            self._flag(view)
            return
        began = self._clock.monotonic()
        job.post_note(status_note(group.group_rank), mine.encode())
        self.store_round_trip = self._clock.monotonic() - began
        if group.group_rank == 0:
            names = [status_note(node) for node in range(group.nodes)]
            posts = [
                post
                for name, raw in job.read_notes(names).items()
                if (post := _decoded(core.NodeStatus.decode, name, raw)) is not None
            ]
            view = core.job_view(posts, self._factor, mine.posted_at)
            if self._evictor is not None:
                view = self._evictor.judge(view, posts, group.nodes, job)
            job.post_note(JOB_NOTE, view.encode())
            if self._evictor is not None:
                self._evictor.heed(view, group.group_rank, job)
            self.view = view
            self.job_line = core.job_bar(view, self._clock.time() - self._started_at)
            self._flag(view)
            return
        raw = job.read_notes([JOB_NOTE]).get(JOB_NOTE)
        judged = None if raw is None else _decoded(core.JobView.decode, JOB_NOTE, raw)
        if judged is not None:
            self.view = judged
            if self._evictor is not None:
                self._evictor.heed(judged, group.group_rank, job)
            self._flag(judged, group.group_rank)

    def _flag(self, view: core.JobView, only: int | None = None) -> None:
        """Say each node of ``view`` newly flagged (``only``: this node rank alone)."""
        slow = [node for node in view.slow_nodes if only is None or node.node_rank == only]
        for node in slow:
            if node.node_rank in self._said:
                continue
            log.warning("%s", core.printable(node.describe()))
            self._on_flag(node)
        self._said = {node.node_rank for node in slow}  # one that caught up is flagged again


def _decoded(decode: Callable[[bytes], _Note], name: str, raw: bytes) -> _Note | None:
    """A note another node posted, or None (and a debug line) when it is not one: a status line
    is best effort, so a bad note is skipped rather than ending the run."""
    try:
        return decode(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        log.debug("skipping the note %r, which is not a status post: %s", name, exc)
        return None
