"""What the agent tells about its run, and the one view of its ranks that every reader shares.

A *run event* (``Joined``, ``Started``, ``AttemptEnded``, ``Restarted``, ``Hung``,
``StragglerFlagged``, ``RestartCosted``, ``Finished``, ``Failed``) is one frozen value that the
agent announces once; each of its sinks (``agent.sinks``: the event log and summary, the
Prometheus counters, torchelastic's metric puts, the status posts, the log) takes from it what it
writes.

A ``NodeSnapshot`` is every local rank's channel slot (progress, liveness) and process state,
read at one moment: the readers of one tick (hang detection, status posts, the node bar, the
crash-loop count, the summary, a scrape) get the same one (``agent.sampler``), so what they show
cannot disagree.

Pure: records in, records out; ``taken_at`` is ``time.time()``, passed in. The records are
``core.value.Value``s: this module loads with every agent, and a named tuple takes about
0.15 ms to define, a value a few microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from relaunch.core.run.failures import describe_exit
from relaunch.core.run.goodput import RestartCost
from relaunch.core.value import Value
from relaunch.core.workers.liveness import Liveness
from relaunch.core.workers.progress import Progress
from relaunch.core.workers.stragglers import SlowNode

# -- the snapshot ---------------------------------------------------------------------------------


class RankSample(Value):
    """One local rank at a snapshot: its last progress report and liveness block (None before
    it wrote one), and its process: ``outcome`` is one of ``core.output.metrics.WORKER_STATES``
    ("running" also while no process is known), ``exitcode`` its code once the group ended;
    ``times`` the seconds it spent in each section name and the runs ended
    (``core.workers.liveness.read_section_times``)."""

    __slots__ = ("exitcode", "liveness", "outcome", "progress", "times")

    progress: Progress | None
    liveness: Liveness | None
    outcome: str
    exitcode: int | None
    times: Mapping[str, tuple[float, int]]

    def __init__(
        self,
        progress: Progress | None = None,
        liveness: Liveness | None = None,
        outcome: str = "running",
        exitcode: int | None = None,
        times: Mapping[str, tuple[float, int]] | None = None,
    ) -> None:
        self._set(progress=progress, liveness=liveness, outcome=outcome, exitcode=exitcode)
        self._set(times={} if times is None else times)

    @property
    def running(self) -> bool:
        return self.outcome == "running"

    @property
    def state(self) -> str:
        """How it stands, in ``relaunch status``'s words: "running", how it ended ("exited 0",
        "killed by SIGKILL"), or "ended" before its group's end tells its code."""
        if self.running:
            return "running"
        return "ended" if self.exitcode is None else describe_exit(self.exitcode)

    @property
    def last_sign(self) -> float | None:
        """When it last showed life through the channel: a report, heartbeat or section."""
        signs = [
            sign
            for sign in (
                None if self.progress is None else self.progress.time,
                None if self.liveness is None else self.liveness.last_sign,
            )
            if sign
        ]
        return max(signs, default=None)


_UNSEEN = RankSample()


class NodeSnapshot(Value):
    """Every local rank of this node as read at ``taken_at`` (``time.time()``), by local rank.

    ``progress``, ``liveness`` and ``slots`` read as the channel's do."""

    __slots__ = ("ranks", "taken_at")

    taken_at: float
    ranks: Mapping[int, RankSample]

    def __init__(
        self, taken_at: float, ranks: Mapping[int, RankSample] = MappingProxyType({})
    ) -> None:
        self._set(taken_at=taken_at, ranks=ranks)

    @property
    def slots(self) -> int:
        return len(self.ranks)

    def rank(self, local: int) -> RankSample:
        """``local``'s sample (a running rank that said nothing, when the snapshot has none)."""
        return self.ranks.get(local, _UNSEEN)

    def progress(self, local: int) -> Progress | None:
        return self.rank(local).progress

    def liveness(self, local: int) -> Liveness | None:
        return self.rank(local).liveness

    def progresses(self) -> dict[int, Progress | None]:
        """Every rank's last progress report, by local rank."""
        return {local: sample.progress for local, sample in self.ranks.items()}

    def running(self) -> set[int]:
        """The local ranks whose process has not exited."""
        return {local for local, sample in self.ranks.items() if sample.running}


# -- the run events -------------------------------------------------------------------------------


class Joined(Value):
    """The agent got its place in a rendezvous round, ``seconds`` after asking."""

    __slots__ = ("seconds",)

    seconds: float

    def __init__(self, seconds: float) -> None:
        self._set(seconds=seconds)


class Started(Value):
    """A group of workers started (``restart_count`` restarts used), after a join that took
    ``rendezvous_seconds``."""

    __slots__ = ("rendezvous_seconds", "restart_count")

    restart_count: int
    rendezvous_seconds: float

    def __init__(self, restart_count: int, rendezvous_seconds: float) -> None:
        self._set(restart_count=restart_count, rendezvous_seconds=rendezvous_seconds)


class AttemptEnded(Value):
    """The restart policy ended an attempt of ``role``'s group: ``state`` is the group's then
    (a ``GroupStatus`` value: SUCCEEDED, FAILED, or RUNNING when it stops to re-form), with
    ``restarts_left`` before any restart it leads to."""

    __slots__ = ("restarts_left", "role", "state")

    role: str
    state: str
    restarts_left: int

    def __init__(self, role: str, state: str, restarts_left: int) -> None:
        self._set(role=role, state=state, restarts_left=restarts_left)


#: The cause of a restart that evicted a straggler to a spare (``core.workers.eviction``).
EVICTED = "member_evicted"


class Restarted(Value):
    """The group restarts: ``cause`` (``core.output.metrics.RESTART_CAUSES``), ``reason`` in one
    line (a failure's root cause, or the membership change), ``decision`` the restart policy's words
    for it; ``restart_count`` restarts used before it, ``restarts_left`` after it."""

    __slots__ = ("cause", "decision", "reason", "restart_count", "restarts_left", "role")

    role: str
    cause: str
    reason: str
    decision: str
    restart_count: int
    restarts_left: int

    def __init__(
        self,
        role: str,
        cause: str,
        reason: str,
        decision: str,
        restart_count: int,
        restarts_left: int,
    ) -> None:
        self._set(role=role, cause=cause, reason=reason, decision=decision)
        self._set(restart_count=restart_count, restarts_left=restarts_left)


class Hung(Value):
    """A local rank missed its section's or heartbeat's deadline, fell silent past
    ``--hang-timeout``, or outlived its ``relaunch.timer.expires`` block (``what``); every
    rank's stack is being taken."""

    __slots__ = ("restart_count", "what")

    restart_count: int
    what: str

    def __init__(self, restart_count: int, what: str) -> None:
        self._set(restart_count=restart_count, what=what)


class StragglerFlagged(Value):
    """A node was flagged a straggler (``core.workers.stragglers.flagged_nodes``): its ranks
    spend more than ``factor`` times the other nodes' time in a section, or step slower than
    the job's median rate / ``factor``."""

    __slots__ = ("node", "restart_count")

    node: SlowNode
    restart_count: int

    def __init__(self, node: SlowNode, restart_count: int) -> None:
        self._set(node=node, restart_count=restart_count)


class WorkerEnd(Value):
    """How one worker of the last attempt ended: ``state`` a ``WorkerState`` value, ``error``
    the JSON its failure is recorded with (None: it did not fail)."""

    __slots__ = (
        "error",
        "global_rank",
        "local_rank",
        "role_rank",
        "role_world_size",
        "state",
        "worker_id",
    )

    global_rank: int
    local_rank: int
    role_rank: int
    role_world_size: int
    worker_id: str | None
    state: str
    error: str | None

    def __init__(
        self,
        global_rank: int,
        local_rank: int,
        role_rank: int,
        role_world_size: int,
        worker_id: str | None,
        state: str,
        error: str | None = None,
    ) -> None:
        self._set(global_rank=global_rank, local_rank=local_rank, role_rank=role_rank)
        self._set(role_world_size=role_world_size, worker_id=worker_id, state=state, error=error)


class Finished(Value):
    """The run ended with ``state`` (a ``WorkerState`` value); ``workers`` says how each
    worker of its last attempt did."""

    __slots__ = ("restart_count", "state", "workers")

    state: str
    restart_count: int
    workers: tuple[WorkerEnd, ...]

    def __init__(self, state: str, restart_count: int, workers: tuple[WorkerEnd, ...] = ()) -> None:
        self._set(state=state, restart_count=restart_count, workers=workers)


class RestartCosted(Value):
    """A restart's seconds lost by cause, once its workers were back (``core.run.goodput``)."""

    __slots__ = ("cost",)

    cost: RestartCost

    def __init__(self, cost: RestartCost) -> None:
        self._set(cost=cost)


class Failed(Value):
    """The run ended by an error: the agent failed (``error``: what it said, if anything)."""

    __slots__ = ("error", "restart_count")

    restart_count: int
    error: str | None

    def __init__(self, restart_count: int, error: str | None = None) -> None:
        self._set(restart_count=restart_count, error=error)


RunEvent = (
    Joined
    | Started
    | AttemptEnded
    | Restarted
    | Hung
    | StragglerFlagged
    | RestartCosted
    | Finished
    | Failed
)
