"""What the agent's step (``core.step``) takes and returns: observations, what the agent saw,
and actions, what it is to do next. Frozen values, compared whole in the step's tests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from relaunch.core.failures import Failure
from relaunch.core.happenings import Happening, NodeSnapshot
from relaunch.core.membership import MembershipChange

# -- observations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Began:
    """The run begins."""


@dataclass(frozen=True)
class Placed:
    """This node joined a group of ``nodes`` nodes; the job has used ``used`` restarts."""

    nodes: int
    used: int


@dataclass(frozen=True)
class JobClosed:
    """The job finished (or failed) while this node re-formed."""


@dataclass(frozen=True)
class WorkersStarted:
    """The workers of a new attempt started."""


@dataclass(frozen=True)
class StacksPending:
    """Ranks asked for their stacks still run: their stacks are due within ``seconds``."""

    seconds: float


@dataclass(frozen=True)
class Ended:
    """How the workers ended: ``failures`` by global rank (none: every worker succeeded),
    ``local_ranks`` each global rank's local rank, and what each local rank said in the channel
    (its progress, heartbeats and sections: ``snapshot``, read when they failed)."""

    failures: Mapping[int, Failure] = field(default_factory=dict)
    local_ranks: Mapping[int, int] = field(default_factory=dict)
    snapshot: NodeSnapshot = field(default_factory=lambda: NodeSnapshot(0.0))

    @property
    def failed(self) -> bool:
        return bool(self.failures)


@dataclass(frozen=True)
class Looked:
    """How the workers stand (``ended`` None: they run) and the membership change, if any;
    ``used``: the job's restart count, read when the workers failed."""

    ended: Ended | None = None
    change: MembershipChange | None = None
    used: int | None = None


@dataclass(frozen=True)
class PeersAnswered:
    """The roll call's outcome (None: cannot tell), and the change that came meanwhile."""

    alive: bool | None
    change: MembershipChange | None = None


@dataclass(frozen=True)
class HangsChecked:
    """Hang detection looked: the hung local rank it names (None: none), in how many seconds it
    looks again (None: never), and the deadline the sleep was asked for (``CheckHangs``)."""

    hang: str | None
    next_check: float | None
    until: float | None


Observation = (
    Began
    | Placed
    | JobClosed
    | WorkersStarted
    | StacksPending
    | Looked
    | PeersAnswered
    | HangsChecked
)

# -- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    """Leave the running round, wait ``backoff`` seconds (a crash loop's), and join again
    (answered by ``Placed``, or ``JobClosed`` while re-forming)."""

    backoff: float = 0.0


@dataclass(frozen=True)
class StartWorkers:
    """Start the workers of the group just joined (answered by ``WorkersStarted``)."""


@dataclass(frozen=True)
class StopWorkers:
    """Stop the workers (SIGTERM, then SIGKILL after the shutdown timeout)."""


@dataclass(frozen=True)
class CheckStore:
    """Before a restart is told: the job ends here if the store was lost with its host."""


@dataclass(frozen=True)
class AskRollCall:
    """Ask whether every other node answers within ``timeout`` (answered by ``PeersAnswered``)."""

    timeout: float


@dataclass(frozen=True)
class TakeStacks:
    """Another node's worker hung (``reason``): ask every running local rank for its stack."""

    reason: str


@dataclass(frozen=True)
class CheckHangs:
    """Before sleeping until ``until`` (None: the next event), let hang detection act on hung
    workers (answered by ``HangsChecked``)."""

    until: float | None


@dataclass(frozen=True)
class Wait:
    """Sleep until an event (the workers ended, a change, a signal) or ``until`` (None: no
    deadline), on the clock the step was given."""

    until: float | None


@dataclass(frozen=True)
class StopForStacks:
    """Ask every other node for its workers' stacks and restart with this one."""

    reason: str


@dataclass(frozen=True)
class FailJob:
    """End the job on every node (``stacks``: a worker hung; they take stacks first)."""

    reason: str
    stacks: bool = False


@dataclass(frozen=True)
class NoteRestart:
    """Tell the other nodes this node spends one of the job's restarts, and why."""

    reason: str


@dataclass(frozen=True)
class ReportFailure:
    """Log the failure report of the workers that just failed."""


@dataclass(frozen=True)
class Say:
    """Log ``text`` (a warning, or an error)."""

    text: str
    error: bool = False


@dataclass(frozen=True)
class StopNote:
    """Why the run stopped, for its summary."""

    text: str


@dataclass(frozen=True)
class Tell:
    """Announce ``happening`` to the agent's sinks (``agent.sinks``)."""

    happening: Happening


@dataclass(frozen=True)
class Succeed:
    """Every worker finished: pass the exit barrier, close the job, return the results."""


@dataclass(frozen=True)
class Fail:
    """This node's workers failed, and that is final: return the failure."""


@dataclass(frozen=True)
class CutShort:
    """The job ended elsewhere and this node's workers with it: end the run with ``message``."""

    message: str


Action = (
    Rendezvous
    | StartWorkers
    | StopWorkers
    | CheckStore
    | AskRollCall
    | TakeStacks
    | CheckHangs
    | Wait
    | StopForStacks
    | FailJob
    | NoteRestart
    | ReportFailure
    | Say
    | StopNote
    | Tell
    | Succeed
    | Fail
    | CutShort
)
