"""The agent's decisions as one pure step: ``step(state, observation, now) -> (state, actions)``.

The agent (``agent.loop``) observes how its workers and the job stand, asks ``step`` what follows,
and performs the actions in order; the step reads no clock (``now`` is given, on the clock of
every deadline it returns) and touches nothing. A run is a history of observations in and
actions out (``tests/unit/test_step.py`` tests it so).

An attempt goes ``Began`` (or a restart) -> ``Rendezvous`` -> ``Joined`` -> ``StartWorkers`` ->
``WorkersStarted``; then the agent looks (``Looked``) and sleeps (``CheckHangs`` ->
``HangsChecked`` -> ``Wait``) until the workers end or the membership changes; then ``Succeed``,
``Fail``, ``CutShort``, or a restart: ``StopWorkers`` ... ``Rendezvous`` again.

The restart budget is the job's (``used``, every node's restarts as the job counts them); this
node's failures ask for ``spent``. With none left, a failure in a group of several nodes is final
at once when every other node answers a roll call; while one does not, it may be dead, and the
agent waits the lost-node grace for its loss to re-form the group for free (``core.restart``).
A crash loop waits its backoff between restarts, and stops after restarts that made no progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from relaunch.core import restart
from relaunch.core.durations import seconds
from relaunch.core.failures import Failure, one_line, root_cause_rank
from relaunch.core.group import GroupState
from relaunch.core.liveness import Liveness
from relaunch.core.membership import MembershipChange
from relaunch.core.progress import Progress
from relaunch.core.restart import Backoff, CrashLoop, Mark, stalled_out, startup_failure

#: Seconds the other nodes have to answer a roll call before one of them may be dead.
ROLL_CALL_TIMEOUT = 1.0
CUT_SHORT = "this node's workers were stopped before they finished"


@dataclass(frozen=True)
class Rules:
    """What a run's decisions depend on that stays fixed while it runs.

    ``node`` names this host in what the other nodes are told; ``polls_membership``: the job
    watches membership but cannot push its changes, so it is looked at every
    ``monitor_interval`` seconds.
    """

    role: str
    node: str
    max_restarts: int
    watches_membership: bool = False
    polls_membership: bool = False
    monitor_interval: float = 0.1
    lost_node_grace: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)
    max_stalled: int = 3
    roll_call_timeout: float = ROLL_CALL_TIMEOUT


@dataclass(frozen=True)
class Reform:
    """A restart under way: whether the workers had failed, and the decision's reason."""

    failed: bool
    reason: str


@dataclass(frozen=True)
class RunState:
    """Everything the next decision depends on, from the observations so far."""

    rules: Rules
    #: Group restarts this node's failures asked for, and those the job used, as last told.
    spent: int = 0
    used: int = 0
    #: Nodes in the group of the last join.
    nodes: int = 1
    #: The roll call's outcome, this round (None: not called, or no answer to go by).
    peers_alive: bool | None = None
    #: Until when a failure with no restart left waits for a lost node to be noticed.
    grace_ends: float | None = None
    #: This attempt's hung local rank, as hang detection last said; whether the job was told,
    #: and whether this attempt's stacks were taken for another node's hang.
    hang: str | None = None
    hang_told: bool = False
    stacks_taken: bool = False
    crash_loop: CrashLoop = field(default_factory=CrashLoop)
    attempt_started: float = 0.0
    #: Some rank used the channel, in this attempt or an earlier one.
    workers_spoke: bool = False
    #: A failure waiting for the roll call's answer.
    roll_call_for: Looked | None = None
    reforming: Reform | None = None

    @property
    def restarts_left(self) -> int:
        return max(0, self.rules.max_restarts - self.used)

    @property
    def alone(self) -> bool:
        """A group of one node has no other node to lose: its failure is final at once."""
        return self.nodes <= 1


# -- observations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Began:
    """The run begins."""


@dataclass(frozen=True)
class Joined:
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
    ``local_ranks`` each global rank's local rank, and by local rank what each worker said in
    the channel (its last progress report, its heartbeats and sections)."""

    failures: Mapping[int, Failure] = field(default_factory=dict)
    local_ranks: Mapping[int, int] = field(default_factory=dict)
    progress: Sequence[Progress | None] = ()
    liveness: Sequence[Liveness | None] = ()

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
    | Joined
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
    (answered by ``Joined``, or ``JobClosed`` while re-forming)."""

    backoff: float = 0.0


@dataclass(frozen=True)
class StartWorkers:
    """Start the workers of the group just joined (answered by ``WorkersStarted``)."""


@dataclass(frozen=True)
class StopWorkers:
    """Stop the workers (SIGTERM, then SIGKILL after the shutdown timeout)."""


@dataclass(frozen=True)
class CheckStore:
    """Before a restart is said: the job ends here if the store was lost with its host."""


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
    """Sleep until ``until`` (None: an event): first let hang detection act on hung workers
    (answered by ``HangsChecked``)."""

    until: float | None


@dataclass(frozen=True)
class Wait:
    """Wait for an event (the workers ended, a change, a signal) up to ``seconds`` (None: no
    limit)."""

    seconds: float | None


@dataclass(frozen=True)
class ReportHung:
    """Report that a local rank hung (``what``), at restart count ``restart_count``."""

    what: str
    restart_count: int


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
class PutMetrics:
    """The restarts left and the group's state, for the metrics handler."""

    restarts_left: int
    state: GroupState


@dataclass(frozen=True)
class Restarting:
    """The group restarts: ``cause`` as a word for counting, ``reason`` in one line."""

    restart_count: int
    cause: str
    reason: str


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
    | ReportHung
    | StopForStacks
    | FailJob
    | NoteRestart
    | ReportFailure
    | Say
    | StopNote
    | PutMetrics
    | Restarting
    | Succeed
    | Fail
    | CutShort
)
Decided = tuple[RunState, list[Action]]


# -- the step -----------------------------------------------------------------------------------


def step(state: RunState, observation: Observation, now: float) -> Decided:
    """The state after ``observation`` (at ``now``), and what the agent does next, in order."""
    if isinstance(observation, Began):
        return state, [Rendezvous()]
    if isinstance(observation, Joined):
        joined = replace(
            state,
            nodes=observation.nodes,
            used=observation.used,
            peers_alive=None,
            reforming=None,
        )
        return joined, [StartWorkers()]
    if isinstance(observation, JobClosed):
        return _closed(state)
    if isinstance(observation, WorkersStarted):
        started = replace(
            state, attempt_started=now, hang=None, hang_told=False, stacks_taken=False
        )
        return started, []
    if isinstance(observation, StacksPending):
        return state, [CheckHangs(now + observation.seconds)]  # let every stack be written
    if isinstance(observation, HangsChecked):
        return _sleep(state, observation, now)
    if isinstance(observation, Looked):
        return _looked(state, observation, now)
    if isinstance(observation, PeersAnswered):
        look = state.roll_call_for
        assert look is not None, "a roll call's answer without a roll call"
        answered = replace(state, peers_alive=observation.alive, roll_call_for=None)
        return _decide(answered, look, observation.change, now)
    raise TypeError(f"not an observation: {observation!r}")


def _looked(state: RunState, look: Looked, now: float) -> Decided:
    """The workers and the job were looked at: decide, after a roll call where it tells."""
    failed = look.ended is not None and look.ended.failed
    if failed and look.used is not None:
        state = replace(state, used=look.used)
    rules = state.rules
    if (
        failed
        and look.change is None
        and state.restarts_left == 0
        and rules.watches_membership
        and not state.alone
        and state.grace_ends is None
    ):
        return replace(state, roll_call_for=look), [AskRollCall(rules.roll_call_timeout)]
    return _decide(state, look, look.change, now)


def _decide(state: RunState, look: Looked, change: MembershipChange | None, now: float) -> Decided:
    rules = state.rules
    ended = look.ended
    group = GroupState.RUNNING if ended is None else _group_state(ended)
    watching_others = rules.watches_membership and not state.alone
    decision = restart.decide(
        group,
        state.restarts_left,
        change,
        lost_node_grace=rules.lost_node_grace if watching_others else 0.0,
        now=now,
        grace_ends=state.grace_ends,
        peers_alive=state.peers_alive,
    )
    actions: list[Action] = []
    if decision.action is restart.Action.AWAIT_CHANGE and state.grace_ends is None:
        actions.append(
            Say(
                "workers failed with no restart left, and not every other node answered: "
                f"waiting up to {seconds(rules.lost_node_grace)} for a lost node to be noticed"
            )
        )
    state = replace(state, grace_ends=decision.deadline)
    if decision.stacks and state.hang is None and not state.stacks_taken:
        return replace(state, stacks_taken=True), [*actions, TakeStacks(decision.reason)]
    if decision.action in (restart.Action.CONTINUE, restart.Action.AWAIT_CHANGE):
        return state, [*actions, CheckHangs(decision.deadline)]
    actions.append(PutMetrics(state.restarts_left, group))
    if decision.action is restart.Action.SUCCEED:
        return state, [*actions, Succeed()]
    if decision.action is restart.Action.FAIL:
        return _fail(state, decision, ended, now, actions)
    return _restart(state, decision, ended, now, actions)


def _fail(
    state: RunState,
    decision: restart.RestartDecision,
    ended: Ended | None,
    now: float,
    actions: list[Action],
) -> Decided:
    """No restart here: the job failed elsewhere, or this node's failure is final."""
    # A worker of another node hung, and this node's ranks gave their stacks.
    elsewhere = decision.stacks and state.hang is None
    if ended is not None and ended.failed and not elsewhere:
        state, cause = _cause(state, ended, now)
        reason = f"{state.rules.node}: {cause} (no restart left)"
        return state, [*actions, FailJob(reason), Fail()]
    if elsewhere and ended is not None and ended.failed:
        actions.append(ReportFailure())  # where this node's ranks were
    return state, [*actions, CutShort(f"{decision.reason}; {CUT_SHORT}")]


def _restart(
    state: RunState,
    decision: restart.RestartDecision,
    ended: Ended | None,
    now: float,
    actions: list[Action],
) -> Decided:
    """Stop the workers and re-form: after a failure (one of the job's restarts, counted in the
    crash loop) or a membership change (free)."""
    rules = state.rules
    reason = decision.reason
    delay = 0.0
    failed = ended is not None and ended.failed
    if ended is not None and failed:
        actions.append(ReportFailure())
        state, reason = _cause(state, ended, now)
        loop = state.crash_loop.after_failure(
            now - state.attempt_started, _mark(ended), rules.backoff
        )
        state = replace(state, crash_loop=loop)
        stalled = stalled_out(loop, rules.max_stalled)
        if stalled is not None:
            return state, [
                *actions,
                Say(f"[{rules.role}] {stalled}", error=True),
                StopNote(stalled),
                FailJob(f"{rules.node}: {reason} ({stalled})"),
                Fail(),
            ]
        delay = rules.backoff.delay(loop.in_a_row)
    # The workers stop before anything is said: if the store's host is gone with the store,
    # the job ends there, and no restart was said or counted.
    actions += [StopWorkers(), CheckStore()]
    restarts_left = state.restarts_left
    if decision.uses_restart:
        state = replace(state, spent=state.spent + 1)
        restarts_left -= 1
    cause = "hang" if state.hang is not None else decision.cause
    actions += [
        Restarting(state.used, cause, reason),
        Say(
            f"[{rules.role}] restarting the worker group ({decision.reason}); "
            f"{restarts_left} restart(s) left"
        ),
    ]
    if decision.uses_restart:  # the other nodes restart because of this: say why
        actions.append(NoteRestart(f"{rules.node}: {reason}"))
    if delay:
        backoff = rules.backoff
        actions.append(
            Say(
                f"[{rules.role}] a crash loop: waiting {seconds(delay)} before restart "
                f"{state.crash_loop.in_a_row} in a row "
                f"(--restart-backoff {backoff.base:g}:{backoff.cap:g})"
            )
        )
    state = replace(state, reforming=Reform(failed, decision.reason))
    return state, [*actions, Rendezvous(delay)]


def _closed(state: RunState) -> Decided:
    """The job ended while this node re-formed."""
    assert state.reforming is not None, "the job closed with no restart under way"
    if state.reforming.failed:  # the other nodes finished the job meanwhile: the failure stands
        return state, [Fail()]
    # Its workers were stopped mid-run to re-form, and the job ended without them (another node
    # failed, or its exit barrier timed out).
    return state, [
        CutShort(f"the job ended while this node re-formed ({state.reforming.reason}); {CUT_SHORT}")
    ]


def _sleep(state: RunState, checked: HangsChecked, now: float) -> Decided:
    """Hang detection looked before the agent sleeps: tell the job of a new hang (restarting
    with this node, or ending the job with no restart left), then wait for the next event."""
    rules = state.rules
    state = replace(state, hang=checked.hang)
    actions: list[Action] = []
    if checked.hang is not None and not state.hang_told:
        state = replace(state, hang_told=True)
        actions.append(ReportHung(checked.hang, state.used))
        if rules.watches_membership and not state.alone:
            reason = f"{rules.node}: {checked.hang}"
            if state.restarts_left > 0:
                actions.append(StopForStacks(reason))
            else:
                actions.append(FailJob(f"{reason} (no restart left)", stacks=True))
    waits = []
    if checked.next_check is not None:
        waits.append(checked.next_check)
    if checked.until is not None:
        waits.append(checked.until - now)
    if rules.polls_membership:
        waits.append(rules.monitor_interval)
    actions.append(Wait(max(0.0, min(waits)) if waits else None))
    return state, actions


def _cause(state: RunState, ended: Ended, now: float) -> tuple[RunState, str]:
    """The root cause of a failed attempt in one line: named a start-up failure when its worker
    had said nothing yet, in a job whose workers speak."""
    rank = root_cause_rank(ended.failures)
    line = one_line(rank, ended.failures[rank])
    local = ended.local_ranks.get(rank, 0)
    spoke = [
        progress is not None or (live is not None and live.used)
        for progress, live in zip(ended.progress, ended.liveness, strict=True)
    ]
    state = replace(state, workers_spoke=state.workers_spoke or any(spoke))
    if startup_failure(spoke[local], state.workers_spoke):
        ran_for = now - state.attempt_started
        return state, f"during start-up ({ran_for:.1f}s after it started): {line}"
    return state, line


def _mark(ended: Ended) -> Mark:
    """How far the failed attempt got, as its workers said."""
    steps = [progress.step for progress in ended.progress if progress is not None]
    signs = sum(live.sections_done + live.beats for live in ended.liveness if live is not None)
    return Mark(max(steps, default=None), signs)


def _group_state(ended: Ended) -> GroupState:
    return GroupState.FAILED if ended.failed else GroupState.SUCCEEDED
