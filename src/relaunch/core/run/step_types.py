"""What the agent's step (``core.run.step``) takes and returns: observations, what the agent saw,
and actions, what it is to do next.

Each is a ``Value`` (``core.value``): a plain frozen class, not a dataclass nor a named tuple,
since the agent makes these classes at every launch: twenty-six of either cost it 4 to 9 ms of
start-up, plain classes a tenth of a millisecond.
"""

from __future__ import annotations

from collections.abc import Mapping

from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.core.run.failures import Failure
from relaunch.core.run.run_events import NodeSnapshot, RunEvent
from relaunch.core.value import Value

_NOT_READ = NodeSnapshot(0.0)

# -- observations -------------------------------------------------------------------------------


class Began(Value):
    """The run begins."""


class Placed(Value):
    """This node joined a group of ``nodes`` nodes; the job has used ``used`` restarts."""

    __slots__ = ("nodes", "used")
    nodes: int
    used: int

    def __init__(self, nodes: int, used: int) -> None:
        self._set(nodes=nodes, used=used)


class JobClosed(Value):
    """The job finished (or failed) while this node re-formed; ``failure``: the failure that
    ended it, if the closing node told one (``requeue`` False: running it again cannot mend
    it)."""

    __slots__ = ("failure", "requeue")
    failure: str
    requeue: bool

    def __init__(self, failure: str = "", requeue: bool = True) -> None:
        self._set(failure=failure, requeue=requeue)


class WorkersStarted(Value):
    """The workers of a new attempt started."""


class NotAgreed(Value):
    """The nodes could not agree on the step their workers resume from (``reason``): none was
    started, since workers started without their state would save over it."""

    __slots__ = ("reason",)
    reason: str

    def __init__(self, reason: str) -> None:
        self._set(reason=reason)


class StacksPending(Value):
    """Ranks asked for their stacks still run: their stacks are due within ``seconds``."""

    __slots__ = ("seconds",)
    seconds: float

    def __init__(self, seconds: float) -> None:
        self._set(seconds=seconds)


class Ended(Value):
    """How the workers ended: ``failures`` by global rank (none: every worker succeeded),
    ``local_ranks`` each global rank's local rank, and what each local rank said in the channel
    (its progress, heartbeats and sections: ``snapshot``, read when they failed)."""

    __slots__ = ("failures", "local_ranks", "snapshot")
    failures: Mapping[int, Failure]
    local_ranks: Mapping[int, int]
    snapshot: NodeSnapshot

    def __init__(
        self,
        failures: Mapping[int, Failure],
        local_ranks: Mapping[int, int],
        snapshot: NodeSnapshot = _NOT_READ,
    ) -> None:
        self._set(failures=failures, local_ranks=local_ranks, snapshot=snapshot)

    @property
    def failed(self) -> bool:
        return bool(self.failures)


class Observed(Value):
    """How the workers stand (``ended`` None: they run) and the membership change, if any;
    ``used``: the job's restart count, read when the workers failed; ``failing``: the failures
    of workers whose group is still being stopped because of them (``ended`` is None)."""

    __slots__ = ("change", "ended", "failing", "used")
    ended: Ended | None
    change: MembershipChange | None
    used: int | None
    failing: Ended | None

    def __init__(
        self,
        ended: Ended | None = None,
        change: MembershipChange | None = None,
        used: int | None = None,
        failing: Ended | None = None,
    ) -> None:
        self._set(ended=ended, change=change, used=used, failing=failing)


class PeersAnswered(Value):
    """The presence check's outcome (None: cannot tell), and the change that came meanwhile."""

    __slots__ = ("alive", "change")
    alive: bool | None
    change: MembershipChange | None

    def __init__(self, alive: bool | None, change: MembershipChange | None = None) -> None:
        self._set(alive=alive, change=change)


class HangsChecked(Value):
    """Hang detection looked: the hung local rank it names (None: none), in how many seconds it
    looks again (None: never), and the deadline the sleep was asked for (``CheckHangs``)."""

    __slots__ = ("hang", "next_check", "until")
    hang: str | None
    next_check: float | None
    until: float | None

    def __init__(self, hang: str | None, next_check: float | None, until: float | None) -> None:
        self._set(hang=hang, next_check=next_check, until=until)


Observation = (
    Began
    | Placed
    | JobClosed
    | WorkersStarted
    | NotAgreed
    | StacksPending
    | Observed
    | PeersAnswered
    | HangsChecked
)

# -- actions ------------------------------------------------------------------------------------


class Rendezvous(Value):
    """Leave the running round, wait ``backoff`` seconds (a crash loop's), and join again
    (answered by ``Placed``, or ``JobClosed`` while re-forming)."""

    __slots__ = ("backoff",)
    backoff: float

    def __init__(self, backoff: float = 0.0) -> None:
        self._set(backoff=backoff)


class StartWorkers(Value):
    """Start the workers of the group just joined (answered by ``WorkersStarted``, or
    ``NotAgreed``)."""


class StopWorkers(Value):
    """Stop the workers (SIGTERM, then SIGKILL after the shutdown timeout). ``park``: the stop
    is for a failure that broke the group's collectives: ranks that restart in place
    (``relaunch.restart_in_place``) are let park and kept for the next attempt."""

    __slots__ = ("park",)
    park: bool

    def __init__(self, park: bool = False) -> None:
        self._set(park=park)


class CheckStore(Value):
    """Before a restart is told: the job ends here if the store was lost with its host."""


class CheckPresence(Value):
    """Ask whether every other node answers within ``timeout`` (answered by ``PeersAnswered``)."""

    __slots__ = ("timeout",)
    timeout: float

    def __init__(self, timeout: float) -> None:
        self._set(timeout=timeout)


class TakeStacks(Value):
    """Another node's worker hung (``reason``): ask every running local rank for its stack."""

    __slots__ = ("reason",)
    reason: str

    def __init__(self, reason: str) -> None:
        self._set(reason=reason)


class CheckHangs(Value):
    """Before sleeping until ``until`` (None: the next event), let hang detection act on hung
    workers (answered by ``HangsChecked``)."""

    __slots__ = ("until",)
    until: float | None

    def __init__(self, until: float | None) -> None:
        self._set(until=until)


class Wait(Value):
    """Sleep until an event (the workers ended, a change, a signal) or ``until`` (None: no
    deadline), on the clock the step was given."""

    __slots__ = ("until",)
    until: float | None

    def __init__(self, until: float | None) -> None:
        self._set(until=until)


class StopForStacks(Value):
    """Ask every other node for its workers' stacks and restart with this one."""

    __slots__ = ("reason",)
    reason: str

    def __init__(self, reason: str) -> None:
        self._set(reason=reason)


class FailJob(Value):
    """End the job on every node (``stacks``: a worker hung; they take stacks first;
    ``requeue`` False: restarting cannot help, and every node says not to requeue the job)."""

    __slots__ = ("reason", "requeue", "stacks")
    reason: str
    stacks: bool
    requeue: bool

    def __init__(self, reason: str, stacks: bool = False, requeue: bool = True) -> None:
        self._set(reason=reason, stacks=stacks, requeue=requeue)


class NoteRestart(Value):
    """Tell the other nodes this node spends one of the job's restarts, and why."""

    __slots__ = ("reason",)
    reason: str

    def __init__(self, reason: str) -> None:
        self._set(reason=reason)


class LeaveRound(Value):
    """Leave the running round now, so that the other nodes stop their workers and re-form
    while this node's are still being stopped (after ``NoteRestart``: the restart it spends)."""


class ReportFailure(Value):
    """Log the failure report of the workers that just failed."""


class LogLine(Value):
    """Log ``text`` (a warning, or an error)."""

    __slots__ = ("error", "text")
    text: str
    error: bool

    def __init__(self, text: str, error: bool = False) -> None:
        self._set(text=text, error=error)


class StopNote(Value):
    """Why the run stopped, for its summary."""

    __slots__ = ("text",)
    text: str

    def __init__(self, text: str) -> None:
        self._set(text=text)


class Announce(Value):
    """Announce ``run_event`` to the agent's sinks (``agent.sinks``)."""

    __slots__ = ("run_event",)
    run_event: RunEvent

    def __init__(self, run_event: RunEvent) -> None:
        self._set(run_event=run_event)


class Succeed(Value):
    """Every worker finished: pass the exit barrier, close the job, return the results."""


class Fail(Value):
    """This node's workers failed, and that is final: return the failure (``requeue`` False:
    running the job again cannot help either)."""

    __slots__ = ("requeue",)
    requeue: bool

    def __init__(self, requeue: bool = True) -> None:
        self._set(requeue=requeue)


class EndedElsewhere(Value):
    """The job ended elsewhere and this node's workers with it: end the run with ``message``
    (``requeue`` False: the job ended for a failure that running it again cannot mend)."""

    __slots__ = ("message", "requeue")
    message: str
    requeue: bool

    def __init__(self, message: str, requeue: bool = True) -> None:
        self._set(message=message, requeue=requeue)


Action = (
    Rendezvous
    | StartWorkers
    | StopWorkers
    | CheckStore
    | CheckPresence
    | TakeStacks
    | CheckHangs
    | Wait
    | StopForStacks
    | FailJob
    | NoteRestart
    | LeaveRound
    | ReportFailure
    | LogLine
    | StopNote
    | Announce
    | Succeed
    | Fail
    | EndedElsewhere
)
