"""What finds a stuck worker for the agent: expiry timers, and hang detection for code without.

* **Timers** (``--timers``, or ``TORCHELASTIC_ENABLE_FILE_TIMER=1``): a ``FileTimerServer``
  reads requests on a FIFO it gives workers as ``TORCHELASTIC_TIMER_FILE``, and reaps a worker
  whose ``relaunch.timer.expires`` block runs past its deadline.
* **Hangs** (``--hang-timeout SECONDS``): a worker that shows no sign of life (its log files do
  not grow, it touches no timer) for that long is asked for its stack with SIGABRT (workers get
  ``PYTHONFAULTHANDLER=1``, so Python dumps every thread's stack to stderr), then SIGKILLed if
  it is still there after ``ABORT_GRACE`` seconds; every other running local rank is asked for
  its stack too, and ``hang`` names it for the agent, as for an overdue section.
* **Overdue sections** (``relaunch.section``, ``relaunch.heartbeat``): a worker past a deadline
  it set itself is hung; every local rank is asked for its stack (SIGABRT), so the report shows
  where each one was, not only the late one. ``hang`` then names it for the agent, which asks
  the other nodes for their ranks' stacks too (``dump_stacks``); where every rank stopped then
  names the rank the others waited for (``agent.culprit``).

Either way the death is a failure like any other, and ``ExpiryWatch.explain`` says why in its
report.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from relaunch.core.durations import seconds
from relaunch.core.run.failures import AT_EXIT, faulthandler_dump, waits_at_exit
from relaunch.core.run.run_events import NodeSnapshot
from relaunch.core.workers import timers as core_timers
from relaunch.core.workers.liveness import Overdue, next_due, overdue
from relaunch.core.workers.timers import ENABLE_FILE_TIMER_ENV, TIMER_FILE_ENV, Timer
from relaunch.procs.handles import signal_tree
from relaunch.runtime import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from relaunch.procs.process_failure import ProcessFailure
    from relaunch.timer.file_based_local_timer import FileTimerServer

log = logging.getLogger(__name__)

#: Seconds a worker asked for its stack (SIGABRT) has to die before it is SIGKILLed.
ABORT_GRACE = 5.0
#: The longest last output line a hang report quotes.
LAST_LINE_CHARS = 200
#: How often the timer server looks at its FIFO when no deadline is near (it wakes for each
#: request and each deadline anyway).
TIMER_MAX_INTERVAL = 1.0
FAULT_HANDLER_ENV = "PYTHONFAULTHANDLER"
#: How often the channel is read for a section or heartbeat deadline set since the last look,
#: once a worker uses them (its first use wakes the agent: ``Channel``'s wake FIFO). A deadline
#: already seen is acted on when it passes.
LIVENESS_LOOK = 0.5


def timers_enabled_by_env() -> bool:
    """torchrun's switch: ``TORCHELASTIC_ENABLE_FILE_TIMER=1``."""
    return os.environ.get(ENABLE_FILE_TIMER_ENV, "") == "1"


class ExpiryWatch:
    """Expiry timers and hang detection for the workers of one agent: runs the file timer server
    that reaps workers past their ``expires`` deadline, and finds workers that hang. ``clock``
    is read for wall-clock time (``clock.time()``), the timer server's too."""

    def __init__(
        self, run_id: str, timers: bool, hang_timeout: float | None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        if hang_timeout is not None and not hang_timeout > 0:
            raise ValueError(
                f"hang_timeout must be a positive number of seconds, got {hang_timeout!r}"
            )
        self._run_id = run_id
        self._clock = clock  # wall-clock time: log files' mtimes are compared with it
        self._hang_timeout = hang_timeout
        self._causes: dict[int, str] = {}
        self._pids: dict[int, int] = {}  # local rank -> pid of the running group
        self._log_files: dict[int, list[str]] = {}
        self._snapshot: Callable[[], NodeSnapshot] = lambda: NodeSnapshot(0.0)
        self._lives_used = False
        self._hold: Callable[[], None] = lambda: None
        self._before_stacks: Callable[[Collection[int]], None] = lambda hung: None
        self._hung_at: dict[int, float] = {}  # pid -> the deadline it missed
        #: Local rank -> when a hung rank last made progress (else last showed a sign of life):
        #: the time lost to the hang, for the goodput ledger, runs from there.
        self._hung_since: dict[int, float] = {}
        #: Why this group's ranks were asked for their stacks (an overdue section here, or
        #: another node's request); None while nobody asked.
        self.hang: str | None = None
        self._asked: str | None = None  # another node's hang, for which the stacks were taken
        self._started_at = 0.0
        self._aborted: dict[int, float] = {}  # pid -> when SIGABRT was sent
        self._timer_dir: str | None = None
        self._server: FileTimerServer | None = None
        if timers:
            from relaunch.timer.file_based_local_timer import FileTimerServer, descendant_of

            path = os.environ.get(TIMER_FILE_ENV)
            if not path:
                self._timer_dir = tempfile.mkdtemp(prefix="relaunch_timer_")
                path = os.path.join(self._timer_dir, "timers.fifo")
            self._server = FileTimerServer(
                path,
                run_id,
                TIMER_MAX_INTERVAL,
                on_reap=self._on_reap,
                may_reap=descendant_of(lambda: set(self._pids.values())),
                clock=clock,
            )

    @property
    def hang_timeout(self) -> float | None:
        return self._hang_timeout

    @property
    def stacks_taken(self) -> bool:
        """Whether this attempt's ranks were asked for their stacks for a hang (here or on
        another node): where they stopped then names the hang's culprit."""
        return self.hang is not None or self._asked is not None

    def start(self) -> None:
        if self._server is not None:
            self._server.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        if self._timer_dir is not None:
            shutil.rmtree(self._timer_dir, ignore_errors=True)

    def worker_env(self) -> dict[str, str]:
        """What every worker's environment gets."""
        env = {}
        if self._server is not None:
            env[TIMER_FILE_ENV] = self._server.file_path
        if FAULT_HANDLER_ENV not in os.environ:  # a hang's SIGABRT prints every rank's stack
            env[FAULT_HANDLER_ENV] = "1"
        return env

    def watch(
        self,
        pids: Mapping[int, int],
        log_files: Mapping[int, list[str]],
        snapshot: Callable[[], NodeSnapshot],
        hold: Callable[[], None] = lambda: None,
        before_stacks: Callable[[Collection[int]], None] = lambda hung: None,
    ) -> None:
        """A new group started: ``pids`` and ``log_files`` by local rank; ``snapshot()`` reads
        the ranks now (``agent.sampler.Sampler.take``): which have not exited (a finished worker
        is not hung), their last ``report_progress``, heartbeats and sections; ``hold()`` keeps
        one worker's death from stopping the others while stacks are taken;
        ``before_stacks(hung)`` is called before every rank is asked for its stack, ``hung``
        the local ranks found hung here (the agent's just-in-time save: SIGABRT ends them)."""
        self._snapshot = snapshot
        self._hold = hold
        self._before_stacks = before_stacks
        self._hung_at.clear()
        self._hung_since.clear()
        self._lives_used = False
        self.hang = self._asked = None
        if self._server is not None:
            self._server.forget(self._pids.values())
        self._pids = dict(pids)
        self._log_files = {rank: list(paths) for rank, paths in log_files.items()}
        self._causes.clear()
        self._aborted.clear()
        self._started_at = self._clock.time()

    # -- hangs ----------------------------------------------------------------------------------

    def _last_sign(self, rank: int, snapshot: NodeSnapshot) -> float:
        seen = self._started_at
        for path in self._log_files.get(rank, ()):
            try:
                seen = max(seen, os.stat(path).st_mtime)
            except OSError:
                pass
        if self._server is not None:
            seen = max(seen, self._server.last_activity(self._pids[rank]) or 0.0)
        progress, live = snapshot.progress(rank), snapshot.liveness(rank)
        if progress is not None:
            seen = max(seen, progress.time)
        if live is not None:
            seen = max(seen, live.last_sign)
        return seen

    def hung_since(self) -> dict[int, float]:
        """This attempt's hung local ranks, and when each last made progress (else last showed
        a sign of life): where the time its hang lost begins."""
        return dict(self._hung_since)

    def _note_hung(self, rank: int, snapshot: NodeSnapshot, last_sign: float) -> None:
        """``rank`` is hung: since its last progress this attempt, else since ``last_sign``."""
        progress = snapshot.progress(rank)
        made = progress.time if progress is not None else 0.0
        self._hung_since.setdefault(rank, made if made >= self._started_at else last_sign)

    def check(self, restarts_left: int | None = None) -> float | None:
        """Act on hung workers now; the seconds until the next check is due (None: never).
        ``restarts_left``: the restarts the job has left, for what a hang's line says comes
        next (None: it says nothing of that)."""
        if not self._pids:
            return None
        now = self._clock.time()
        snapshot = self._snapshot()
        waits = []
        look = self._check_liveness(snapshot, now)
        if look is not None:
            waits.append(look)
        for pid, aborted_at in list(self._aborted.items()):
            if now - aborted_at >= ABORT_GRACE:
                log.warning("pid %d did not die of SIGABRT within %gs: SIGKILL", pid, ABORT_GRACE)
                signal_tree(pid, signal.SIGKILL)
                del self._aborted[pid]
            else:
                waits.append(aborted_at + ABORT_GRACE - now)
        if self._hang_timeout is not None:
            running = snapshot.running()
            live = {
                rank: self._last_sign(rank, snapshot)
                for rank, pid in self._pids.items()
                if rank in running and pid not in self._causes
            }
            hung, next_at = core_timers.silent(live, now, self._hang_timeout)
            for rank in hung:
                self._note_hung(rank, snapshot, live[rank])
                self._hung(rank, now - live[rank], restarts_left)
            if hung:
                self._silent(hung, now - live[hung[0]])
            if next_at is not None:
                waits.append(next_at - now)
        return max(0.0, min(waits)) if waits else None

    def _check_liveness(self, snapshot: NodeSnapshot, now: float) -> float | None:
        """Act on overdue sections and heartbeats; the seconds until the channel is read again
        (None: no worker uses them yet)."""
        if self.hang is not None or self._asked is not None:
            return LIVENESS_LOOK  # the group's stacks were asked for: it is ending
        lives = {rank: snapshot.liveness(rank) for rank in snapshot.running()}
        self._lives_used = self._lives_used or any(
            live is not None and live.used for live in lives.values()
        )
        late = overdue(lives, now)
        if late:
            self._overdue(late, snapshot, now)
            return LIVENESS_LOOK
        if not self._lives_used:
            return None
        due = next_due(lives)
        return LIVENESS_LOOK if due is None else min(LIVENESS_LOOK, due - now)

    def _overdue(self, late: list[Overdue], snapshot: NodeSnapshot, now: float) -> None:
        """Ranks are past their deadlines: ask every local rank for its stack."""
        names = ", ".join(f"local rank {o.rank}: {o.describe(now)}" for o in late)
        first = late[0]
        self.hang = f"local rank {first.rank} is hung ({first.describe(now)})"
        log.warning("%s: asking every local rank for its stack (SIGABRT)", names)
        for o in late:
            self._note_hung(o.rank, snapshot, self._last_sign(o.rank, snapshot))
            self._hung_at[self._pids[o.rank]] = o.due
            self._causes[self._pids[o.rank]] = (
                f"hung: {o.describe(now)}; relaunch sent SIGABRT to every local rank for its stack"
            )
        self._dump_running(f"its stack was taken because {self.hang}", {o.rank for o in late})

    def dump_stacks(self, why: str) -> bool:
        """Another node found a hang (``why``): ask every running local rank for its stack;
        whether this started it (False: the stacks were already asked for)."""
        if self.hang is not None or self._asked is not None:
            return False
        self._asked = why
        self._dump_running(f"its stack was taken because {why}")
        return True

    def _dump_running(self, cause: str, hung: Collection[int] = ()) -> None:
        self._hold()
        self._before_stacks(hung)
        for rank in sorted(self._snapshot().running()):
            pid = self._pids.get(rank)
            if pid is not None and pid not in self._causes:
                self._causes[pid] = cause
            if pid is not None:
                self._abort(pid)

    def dumping(self) -> float:
        """Seconds left before the ranks asked for their stacks are given up on (0: none)."""
        if not self._aborted:
            return 0.0
        now = self._clock.time()
        return max(0.0, max(at + ABORT_GRACE for at in self._aborted.values()) - now)

    def _last_output_line(self, rank: int) -> str | None:
        """The last line ``rank`` wrote (in the log file written last), or None: no output."""
        written = []
        for path in self._log_files.get(rank, ()):
            try:
                written.append((os.stat(path).st_mtime, path))
            except OSError:
                pass
        from relaunch.procs.process_failure import read_tail  # a hang or a failure: loaded then

        for _, path in sorted(written, reverse=True):
            lines = [line for line in read_tail(path, 4096).splitlines() if line.strip()]
            if lines:
                line = lines[-1].split("\r")[-1] or lines[-1]  # a progress bar's last redraw
                return line if len(line) <= LAST_LINE_CHARS else line[:LAST_LINE_CHARS] + "..."
        return None

    def _hung(self, rank: int, silent_for: float, restarts_left: int | None) -> None:
        pid = self._pids[rank]
        last = self._last_output_line(rank)
        after = (
            "since it started, and it wrote no output"
            if last is None
            else f"after its last output line {last!r}"
        )
        self._causes[pid] = (
            f"hung: no output, progress or timer activity for {silent_for:.1f}s {after} "
            f"(--hang-timeout {self._hang_timeout:g}); relaunch sent SIGABRT to get its stack"
        )
        log.warning(
            "local rank %d (pid %d) shows no sign of life for %.1fs: sending SIGABRT "
            "for its stack%s",
            rank,
            pid,
            silent_for,
            _what_follows(restarts_left),
        )

    def _silent(self, hung: list[int], silent_for: float) -> None:
        """Ranks fell silent: ask every other running local rank for its stack too, and name
        the hang for the agent, which asks the other nodes (a hang's culprit is found by
        comparing every rank's stack: ``core.run.culprit``)."""
        if self.hang is not None or self._asked is not None:  # the others' were asked for
            for rank in hung:
                self._abort(self._pids[rank])
            return
        self.hang = (
            f"local rank {hung[0]} is hung (no output, progress or timer activity for "
            f"{silent_for:.1f}s, --hang-timeout {self._hang_timeout:g})"
        )
        self._dump_running(f"its stack was taken because {self.hang}", hung)

    def _abort(self, pid: int) -> None:
        """Ask ``pid`` for its stack: SIGABRT, with Python's fault handler enabled."""
        if pid in self._aborted:
            return
        try:
            # The stack is what is wanted, not a core file of the whole address space.
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
        except (OSError, ValueError):
            pass
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            return
        self._aborted[pid] = self._clock.time()

    # -- timers ---------------------------------------------------------------------------------

    def _on_reap(self, worker: object, timers: list[Timer]) -> None:
        pid = int(str(worker))
        scopes = "; ".join(
            f"expiry timer {t.scope!r} expired: the block was given {seconds(t.allowed)}"
            for t in timers
        )
        self._causes[pid] = f"{scopes} (relaunch.timer.expires); relaunch reaped it"
        rank = next((r for r, p in self._pids.items() if p == pid), None)
        log.warning("local rank %s (pid %d) reaped: %s", rank, pid, scopes)

    # -- reports --------------------------------------------------------------------------------

    def explain(
        self, failures: Mapping[int, ProcessFailure], stderr_files: Mapping[int, str]
    ) -> None:
        """Put why a worker was killed (reaped, or aborted as hung) at the head of its failure's
        ``details``."""
        from relaunch.procs.process_failure import NO_DETAIL_HINT, read_tail

        for rank, failure in failures.items():
            cause = self._causes.get(failure.pid)
            if cause is None:
                continue
            detail = "" if failure.details == NO_DETAIL_HINT else failure.details
            if failure.pid in self._hung_at:  # the root cause: it hung before anyone died
                failure.failed_at = self._hung_at[failure.pid]
                failure.timestamp = int(failure.failed_at)
            if _asked_for_stack(cause):
                dump = faulthandler_dump(read_tail(stderr_files.get(rank, ""), 256 * 1024))
                if dump and waits_at_exit(dump):
                    cause += f"\n{AT_EXIT}"
                when = "it hung" if cause.startswith("hung") else "relaunch asked for it"
                detail = (
                    f"stack of every thread when {when} ({stderr_files[rank]}):\n{dump}"
                    if dump
                    else detail
                )
            failure.details = f"{cause}\n{detail}" if detail else cause
        self._aborted.clear()


def _what_follows(restarts_left: int | None) -> str:
    """What a hang's line says comes after the stack: a restart, or the run's end."""
    if restarts_left is None:
        return ""
    if restarts_left > 0:
        return ", then restarting the worker group"
    return ", then ending the run (no restart left)"


def _asked_for_stack(cause: str) -> bool:
    """Whether a worker killed for ``cause`` was sent SIGABRT for its stack."""
    return cause.startswith(("hung", "its stack was taken"))
