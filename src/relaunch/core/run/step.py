"""The agent's decisions as one pure step: ``step(state, observation, now) -> (state, actions)``.

The agent (``agent.loop``) observes how its workers and the job stand, asks ``step`` what follows,
and performs the actions in order (``core.run.step_types`` has both); the step reads no clock
(``now`` is given, on the clock of every deadline it returns) and touches nothing. A run is a
history of observations in and actions out (``tests/unit/test_step.py`` tests it so).

An attempt goes ``Began`` (or a restart) -> ``Rendezvous`` -> ``Placed`` -> ``StartWorkers`` ->
``WorkersStarted``; then the agent looks (``Observed``) and sleeps (``CheckHangs`` ->
``HangsChecked`` -> ``Wait``) until the workers end or the membership changes; then ``Succeed``,
``Fail``, ``EndedElsewhere``, or a restart: ``StopWorkers`` ... ``Rendezvous`` again. Nodes that
cannot agree on the state to resume from (``NotAgreed``) start nothing and join again. A failure
that restarts a group of several nodes whatever else comes is told as soon as it is seen
(``Observed.failing``: ``NoteRestart``, ``LeaveRound``), while this node's other workers are still
being stopped, so that every node's workers stop at once.

The restart budget is the job's (``used``: every node's restarts, as the job counts them); this
node's failures ask for ``spent``. With none left, a failure in a group of several nodes is final
at once when every other node answers a presence check; while one does not, it may be dead, and the
agent waits the lost-node grace for its loss to re-form the group for free (``core.run.restart``).
A crash loop waits its backoff between restarts, and stops after restarts that made no progress
or failed the same way: such a stop tells every node not to requeue the job.
"""

# Annotations evaluated, not postponed: a named tuple's field types are then classes,
# where strings made typing compile a forward reference for each field at every start.

from typing import NamedTuple

from relaunch.core.durations import seconds
from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.core.run import restart
from relaunch.core.run.failures import failure_signature, one_line, root_cause_rank
from relaunch.core.run.group import GroupStatus
from relaunch.core.run.restart import (
    Backoff,
    CrashLoop,
    Mark,
    may_stall_out,
    stalled_out,
    startup_failure,
)
from relaunch.core.run.run_events import AttemptEnded, Hung, Restarted
from relaunch.core.run.step_types import (
    Action,
    Announce,
    Began,
    CheckHangs,
    CheckPresence,
    CheckStore,
    Ended,
    EndedElsewhere,
    Fail,
    FailJob,
    HangsChecked,
    JobClosed,
    LeaveRound,
    LogLine,
    NotAgreed,
    NoteRestart,
    Observation,
    Observed,
    PeersAnswered,
    Placed,
    Rendezvous,
    ReportFailure,
    StacksPending,
    StartWorkers,
    StopForStacks,
    StopNote,
    StopWorkers,
    Succeed,
    TakeStacks,
    Wait,
    WorkersStarted,
)
from relaunch.core.value import Value

#: Seconds the other nodes have to answer a presence check before one of them may be dead.
PRESENCE_CHECK_TIMEOUT = 1.0
CUT_SHORT = "this node's workers were stopped before they finished"
#: What a stop that restarting cannot mend adds to the run's summary.
DO_NOT_REQUEUE = "do not requeue the job"


class Rules(NamedTuple):
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
    backoff: Backoff = Backoff()
    max_stalled: int = 3
    presence_check_timeout: float = PRESENCE_CHECK_TIMEOUT


class Reform(Value):
    """A restart under way: whether the workers had failed, and the decision's reason."""

    __slots__ = ("failed", "reason")

    failed: bool
    reason: str

    def __init__(self, failed: bool, reason: str) -> None:
        self._set(failed=failed, reason=reason)


class RunRecord(NamedTuple):
    """Everything the next decision depends on, from the observations so far."""

    rules: Rules
    #: Group restarts this node's failures asked for, and those the job used, as last told.
    spent: int = 0
    used: int = 0
    #: Nodes in the group of the last join.
    nodes: int = 1
    #: The presence check's outcome, this round (None: not called, or no answer to go by).
    peers_alive: bool | None = None
    #: Until when a failure with no restart left waits for a lost node to be noticed.
    grace_ends: float | None = None
    #: This attempt's hung local rank, as hang detection last said; whether the job was told,
    #: and whether this attempt's stacks were taken for another node's hang.
    hang: str | None = None
    hang_told: bool = False
    stacks_taken: bool = False
    crash_loop: CrashLoop = CrashLoop()
    attempt_started: float = 0.0
    #: Some rank used the channel, in this attempt or an earlier one.
    workers_spoke: bool = False
    #: A failure waiting for the presence check's answer.
    presence_check_for: Observed | None = None
    reforming: Reform | None = None
    #: This attempt's failure left the round while its workers were still being stopped
    #: (``LeaveRound``): its restart is decided, counted in the job, and told.
    left_early: bool = False

    @property
    def restarts_left(self) -> int:
        return max(0, self.rules.max_restarts - self.used)

    @property
    def alone(self) -> bool:
        """A group of one node has no other node to lose: its failure is final at once."""
        return self.nodes <= 1


Decided = tuple[RunRecord, list[Action]]


def step(state: RunRecord, observation: Observation, now: float) -> Decided:
    """The state after ``observation`` (at ``now``), and what the agent does next, in order."""
    if isinstance(observation, Began):
        return state, [Rendezvous()]
    if isinstance(observation, Placed):
        placed = state._replace(
            nodes=observation.nodes, used=observation.used, peers_alive=None, reforming=None
        )
        return placed, [StartWorkers()]
    if isinstance(observation, JobClosed):
        return _closed(state, observation)
    if isinstance(observation, WorkersStarted):
        return state._replace(
            attempt_started=now, hang=None, hang_told=False, stacks_taken=False, left_early=False
        ), []
    if isinstance(observation, NotAgreed):  # join again, for free: nothing ran
        reason = f"[{state.rules.role}] {observation.reason}: joining the rendezvous again"
        return state._replace(reforming=Reform(False, observation.reason)), [
            LogLine(reason),
            CheckStore(),
            Rendezvous(),
        ]
    if isinstance(observation, StacksPending):
        return state, [CheckHangs(now + observation.seconds)]  # let every stack be written
    if isinstance(observation, HangsChecked):
        return _sleep(state, observation, now)
    if isinstance(observation, Observed):
        return _looked(state, observation, now)
    if isinstance(observation, PeersAnswered):
        look = state.presence_check_for
        assert look is not None, "a presence check's answer without a presence check"
        answered = state._replace(peers_alive=observation.alive, presence_check_for=None)
        return _decide(answered, look, observation.change, now)
    raise TypeError(f"not an observation: {observation!r}")


def _looked(state: RunRecord, look: Observed, now: float) -> Decided:
    """The workers and the job were looked at: decide, after a presence check where it tells."""
    failed = look.ended is not None and look.ended.failed
    if state.left_early:  # the job's count has this node's restart in it; the change is its own
        look = Observed(look.ended, None, None)
    if (failed or look.failing is not None) and look.used is not None:
        state = state._replace(used=look.used)
    rules = state.rules
    if look.ended is None and look.failing is not None and _leaves_early(state, look):
        failing = look.failing
        rank = root_cause_rank(failing.failures)
        note = NoteRestart(f"{rules.node}: {one_line(rank, failing.failures[rank])}")
        state, actions = _decide(state._replace(left_early=True), look, None, now)
        return state, [note, LeaveRound(), *actions]
    if (
        failed
        and look.change is None
        and state.restarts_left == 0
        and rules.watches_membership
        and not state.alone
        and state.grace_ends is None
    ):
        return state._replace(presence_check_for=look), [
            CheckPresence(rules.presence_check_timeout)
        ]
    return _decide(state, look, look.change, now)


def _leaves_early(state: RunRecord, look: Observed) -> bool:
    """A worker failed and the others are being stopped: the group restarts whatever else comes
    (a restart is left, no change or hang decides otherwise, and no failure could make the
    crash loop stop the job), so the other nodes are told now, to stop their workers while this
    node's stop, rather than after it."""
    rules = state.rules
    return (
        not state.left_early
        and look.change is None
        and rules.watches_membership
        and not state.alone
        and state.restarts_left > 0
        and state.hang is None
        and not may_stall_out(state.crash_loop, rules.max_stalled)
    )


def _decide(
    state: RunRecord, look: Observed, change: MembershipChange | None, now: float
) -> Decided:
    rules = state.rules
    ended = look.ended
    group = GroupStatus.RUNNING if ended is None else _group_status(ended)
    decision = restart.decide(
        group,
        state.restarts_left,
        change,
        lost_node_grace=rules.lost_node_grace
        if rules.watches_membership and not state.alone
        else 0.0,
        now=now,
        grace_ends=state.grace_ends,
        peers_alive=state.peers_alive,
    )
    actions: list[Action] = []
    if decision.action is restart.Action.AWAIT_CHANGE and state.grace_ends is None:
        actions.append(
            LogLine(
                "workers failed with no restart left, and not every other node answered: "
                f"waiting up to {seconds(rules.lost_node_grace)} for a lost node to be noticed"
            )
        )
    state = state._replace(grace_ends=decision.deadline)
    if decision.stacks and state.hang is None and not state.stacks_taken:
        return state._replace(stacks_taken=True), [*actions, TakeStacks(decision.reason)]
    if decision.action in (restart.Action.CONTINUE, restart.Action.AWAIT_CHANGE):
        return state, [*actions, CheckHangs(decision.deadline)]
    actions.append(Announce(AttemptEnded(rules.role, group.value, state.restarts_left)))
    if decision.action is restart.Action.SUCCEED:
        return state, [*actions, Succeed()]
    if decision.action is restart.Action.FAIL:
        return _fail(state, decision, ended, now, actions)
    return _restart(state, decision, ended, now, actions)


def _fail(
    state: RunRecord,
    decision: restart.RestartDecision,
    ended: Ended | None,
    now: float,
    actions: list[Action],
) -> Decided:
    """No restart: the job failed elsewhere, or this node's failure is final."""
    # A worker of another node hung, and this node's ranks gave their stacks.
    elsewhere = decision.stacks and state.hang is None
    if ended is not None and ended.failed and not elsewhere:
        state, cause = _cause(state, ended, now)
        reason = f"{state.rules.node}: {cause} (no restart left)"
        return state, [*actions, FailJob(reason), Fail()]
    if elsewhere and ended is not None and ended.failed:
        actions.append(ReportFailure())  # where this node's ranks were
    return state, [*actions, EndedElsewhere(f"{decision.reason}; {CUT_SHORT}", decision.requeue)]


def _restart(
    state: RunRecord,
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
        signature = failure_signature(ended.failures[root_cause_rank(ended.failures)])
        loop = state.crash_loop.after_failure(
            now - state.attempt_started, _mark(ended), rules.backoff, signature
        )
        state = state._replace(crash_loop=loop)
        stalled = stalled_out(loop, rules.max_stalled)
        if stalled is not None:  # restarting cannot help, nor can running the job again
            return state, [
                *actions,
                LogLine(f"[{rules.role}] {stalled}", error=True),
                StopNote(f"{stalled}; {DO_NOT_REQUEUE}"),
                FailJob(f"{rules.node}: {reason} ({stalled})", requeue=False),
                Fail(requeue=False),
            ]
        delay = rules.backoff.delay(loop.in_a_row)
    # The workers stop before anything is told: if the store's host is gone with the store,
    # the job ends there, and no restart was told or counted.
    cause = "hang" if state.hang is not None else decision.cause
    actions += [StopWorkers(park=cause in restart.BREAKS_COLLECTIVES), CheckStore()]
    restarts_left = state.restarts_left
    if decision.uses_restart:
        state = state._replace(spent=state.spent + 1)
        restarts_left -= 1
    actions.append(
        Announce(Restarted(rules.role, cause, reason, decision.reason, state.used, restarts_left))
    )
    if decision.uses_restart and not state.left_early:  # the others restart for it: say why
        actions.append(NoteRestart(f"{rules.node}: {reason}"))
    if delay:
        backoff = rules.backoff
        actions.append(
            LogLine(
                f"[{rules.role}] a crash loop: waiting {seconds(delay)} before restart "
                f"{state.crash_loop.in_a_row} in a row "
                f"(--restart-backoff {backoff.base:g}:{backoff.cap:g})"
            )
        )
    state = state._replace(reforming=Reform(failed, decision.reason))
    return state, [*actions, Rendezvous(delay)]


def _closed(state: RunRecord, closed: JobClosed) -> Decided:
    """The job ended while this node re-formed: for the failure that ``closed`` tells, if one
    did (its requeue holds here too)."""
    assert state.reforming is not None, "the job closed with no restart under way"
    if state.reforming.failed:  # the other nodes finished the job meanwhile: the failure stands
        return state, [Fail(requeue=closed.requeue)]
    # Its workers were stopped mid-run to re-form, and the job ended without them (another node
    # failed, or its exit barrier timed out).
    why = closed.failure or state.reforming.reason
    message = f"the job ended while this node re-formed ({why}); {CUT_SHORT}"
    return state, [EndedElsewhere(message, closed.requeue)]


def _sleep(state: RunRecord, checked: HangsChecked, now: float) -> Decided:
    """Hang detection looked before the agent sleeps: tell of a new hang (asking the other
    nodes for their stacks, or ending the job with no restart left), then wait for the next
    event, hang detection's next look, the deadline, or the next poll of the membership."""
    rules = state.rules
    state = state._replace(hang=checked.hang)
    actions: list[Action] = []
    if checked.hang is not None and not state.hang_told:
        state = state._replace(hang_told=True)
        actions.append(Announce(Hung(state.used, checked.hang)))
        if rules.watches_membership and not state.alone:
            reason = f"{rules.node}: {checked.hang}"
            if state.restarts_left > 0:
                actions.append(StopForStacks(reason))
            else:
                actions.append(FailJob(f"{reason} (no restart left)", stacks=True))
    wakes = [
        wake
        for wake in (
            None if checked.next_check is None else now + checked.next_check,
            checked.until,
            now + rules.monitor_interval if rules.polls_membership else None,
        )
        if wake is not None
    ]
    return state, [*actions, Wait(min(wakes, default=None))]


def _cause(state: RunRecord, ended: Ended, now: float) -> tuple[RunRecord, str]:
    """The root cause of a failed attempt in one line: named a start-up failure when its worker
    had said nothing yet, in a job whose workers speak."""
    rank = root_cause_rank(ended.failures)
    line = one_line(rank, ended.failures[rank])
    local = ended.local_ranks.get(rank, 0)
    ranks = ended.snapshot
    spoke = [
        ranks.progress(slot) is not None or (live is not None and live.used)
        for slot in range(ranks.slots)
        for live in (ranks.liveness(slot),)
    ]
    state = state._replace(workers_spoke=state.workers_spoke or any(spoke))
    if startup_failure(spoke[local], state.workers_spoke):
        ran_for = now - state.attempt_started
        return state, f"during start-up ({ran_for:.1f}s after it started): {line}"
    return state, line


def _mark(ended: Ended) -> Mark:
    """How far the failed attempt got, as its workers said."""
    ranks = ended.snapshot.ranks.values()
    steps = [rank.progress.step for rank in ranks if rank.progress is not None]
    signs = sum(
        rank.liveness.sections_done + rank.liveness.beats for rank in ranks if rank.liveness
    )
    return Mark(max(steps, default=None), signs)


def _group_status(ended: Ended) -> GroupStatus:
    return GroupStatus.FAILED if ended.failed else GroupStatus.SUCCEEDED
