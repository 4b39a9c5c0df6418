"""The one thread that watches a group of workers: their exits and their tee'd output.

It waits in a single ``selectors`` call on a pidfd per worker, the read end of every tee'd stream,
the pipes return values come through (read as they arrive: a worker never blocks on a full pipe
while the monitor waits for its exit), and a wake-up pipe; deadlines (SIGKILL after a grace
period, giving up on workers that outlive SIGKILL, the end of draining) are the select timeout.
Nothing is polled on a period, except a worker that exited but cannot be reaped yet (a zombie
that a debugger traces), which is looked at again with a growing delay.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable

from relaunch.core.run.group import GroupStatus, group_status
from relaunch.procs.console import Console
from relaunch.procs.handles import StuckWorker, signal_tree, stuck_worker
from relaunch.procs.output_rounds import OutputRounds
from relaunch.procs.signals import signals_deferred
from relaunch.procs.wakeup import Latch
from relaunch.procs.worker_process import FailureGrace, Unreaped, WorkerProcess
from relaunch.runtime import SYSTEM_CLOCK, Clock, report_failure, start_thread

log = logging.getLogger(__name__)

#: After a wake-up that copied output, the monitor lets this long pass before it looks again, so a
#: flood of tiny writes (unbuffered workers: two writes a line) is read in large chunks rather
#: than one wake-up per write. The first line of a burst is never delayed; an idle pipe costs
#: nothing.
COALESCE_SECONDS = 0.0005
#: After the workers are gone, how long to keep reading pipes that descendants which escaped
#: their process group still hold open.
DRAIN_TIMEOUT = 1.0
#: How long after SIGKILL the monitor waits for a worker to be reaped before it gives up on it.
#: A killed process normally goes in milliseconds, one with much memory (a GPU's) in seconds;
#: one stuck in the kernel (uninterruptible sleep in a driver, a frozen cgroup, a zombie that a
#: debugger traces) may never go. Past this the group ends without it: it is logged with its
#: state, listed in ``GroupMonitor.stuck``, and nothing waits for it any more.
KILL_DEADLINE = 5.0
#: At most this many bytes of a return value are read per wake-up, so that a large value
#: arriving does not hold up the other workers' output.
RESULT_READ_LIMIT = 8 << 20


class GroupMonitor:
    """Watches the workers of one group; stops the rest as soon as one fails.

    ``on_done`` is called (in the monitor thread) once every worker has exited, or was given up
    on ``KILL_DEADLINE`` s after SIGKILL (see ``stuck``): the caller builds its result there.
    ``stop`` and ``finish`` may be called from any thread. Deadlines and exit times are read
    from ``clock``.
    """

    def __init__(
        self,
        workers: list[WorkerProcess],
        stop_timeout: float,
        on_done: Callable[[], None],
        console: Console | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.workers = {worker.local_rank: worker for worker in workers}
        self._console = console
        self._clock = clock
        self.stop_timeout = stop_timeout
        self.stopped_ranks: set[int] = set()
        #: A failure does not stop the others (every worker was asked for its stack, and each
        #: must finish writing it); the caller stops them.
        self.holding = False
        #: Asked at the group's first failure how long the others' stop may wait for them to
        #: save their state (``FailureGrace``); None: stopped at once.
        self.grace: FailureGrace | None = None
        self._grace_until: float | None = None
        #: The workers given up on, by local rank: still alive ``KILL_DEADLINE`` s after SIGKILL.
        self.stuck: dict[int, StuckWorker] = {}
        self.lock = threading.Condition()
        self._on_done = on_done
        self._done = False
        self._ended = Latch()
        self._failed = Latch()
        self._kill_at: float | None = None
        self._give_up_at: float | None = None
        self._unreaped = Unreaped()
        self._finishing = False
        self._drain_until: float | None = None
        self._keeping: list[WorkerProcess] = []
        self._selector = selectors.DefaultSelector()
        self._output = OutputRounds(self._selector)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        for worker in workers:
            self._selector.register(worker.handle.exit_fd, selectors.EVENT_READ, ("exit", worker))
            for stream in worker.streams:
                self._selector.register(stream.read_fd, selectors.EVENT_READ, ("tee", stream))
            if worker.result is not None:
                self._selector.register(worker.result.fd, selectors.EVENT_READ, ("result", worker))
        self._thread: threading.Thread | None = None
        #: What ended the monitor thread, if it failed (see ``_fail``).
        self.failure: Exception | None = None

    def start(self) -> None:
        if self._console is not None:
            self._console.add_waker(self._wake)
        self._thread = start_thread(self._run, "relaunch-monitor")

    # -- called from any thread -------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done

    def wait_done(self, timeout: float | None) -> bool:
        """Whether every worker exited, waiting up to ``timeout`` seconds (None: no limit); the
        main thread sleeps outside any lock, woken by a signal at once (see ``Latch``)."""
        return self._ended.wait(timeout)

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once every worker has exited (at once if they have)."""
        self._ended.add_callback(callback)

    def add_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, at the group's first failure, as the others' stop begins
        (at once if one failed already)."""
        self._failed.add_callback(callback)

    def stop(self, sig: int, timeout: float) -> None:
        """Send ``sig`` to every worker tree; SIGKILL whatever still runs ``timeout`` s later."""
        with signals_deferred(), self.lock:
            self._stop_locked(sig, timeout)
        self._wake()

    def kill_all_trees(self) -> None:
        """SIGKILL every worker's process group, including descendants of workers that exited
        (not those kept to restart in place)."""
        for worker in self.workers.values():
            if not worker.kept:
                signal_tree(worker.pid, signal.SIGKILL)

    def keep(self, local_rank: int) -> bool:
        """The worker waits to restart in place: it ends for this group as a stopped worker
        (exit code 0) but lives on, never signalled by it; what it wrote is read, and its
        streams are let go (the next attempt gives it new ones). False when it had ended."""
        with signals_deferred(), self.lock:
            worker = self.workers.get(local_rank)
            if worker is None or worker.exitcode is not None or worker.kept:
                return False
            worker.kept = True
            self.stopped_ranks.add(local_rank)
            self._keeping.append(worker)
        self._wake()
        return True

    def finish(self) -> None:
        """Drain the streams (bounded), then end the monitor thread and release everything."""
        with signals_deferred(), self.lock:
            self._finishing = True
            self._drain_until = self._clock.monotonic() + DRAIN_TIMEOUT
        self._wake()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join()

    # -- the monitor thread --------------------------------------------------------------------

    def end_grace(self) -> None:
        """The workers saved (``FailureGrace``): stop the failed group now."""
        with signals_deferred(), self.lock:
            if self._grace_until is None:
                return
            self._grace_until = None
            self._stop_locked(signal.SIGTERM, self.stop_timeout)
        self._wake()

    def _stop_locked(self, sig: int, timeout: float) -> None:
        self._grace_until = None
        running = [w for w in self.workers.values() if w.exitcode is None]
        deadline = self._clock.monotonic() + timeout
        # A second stop (a Ctrl-C during a stop) may only bring the SIGKILL closer.
        self._kill_at = deadline if self._kill_at is None else min(self._kill_at, deadline)
        for worker in self.workers.values():
            if not worker.kept:
                signal_tree(worker.pid, sig)
        if sig == signal.SIGKILL:
            self._give_up_after_kill()
        if not self._done:
            self.stopped_ranks.update(w.local_rank for w in running)

    def _give_up_after_kill(self) -> None:
        """Set the deadline past which workers that outlive the SIGKILL just sent are given up."""
        deadline = self._clock.monotonic() + KILL_DEADLINE
        self._give_up_at = deadline if self._give_up_at is None else min(self._give_up_at, deadline)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _timeout(self) -> float | None:
        now = self._clock.monotonic()
        deadlines = (
            self._kill_at,
            self._give_up_at,
            self._unreaped.at,
            self._drain_until,
            self._grace_until,
        )
        waits = [d - now for d in deadlines if d is not None]
        if self._console is not None:
            tick = self._console.next_tick()
            if tick is not None:
                waits.append(tick)
        return max(0.0, min(waits)) if waits else None

    def _run(self) -> None:
        """The thread: watch until the group ended and its output is drained. Whatever raises
        in it, the group still ends (``_fail``), so that ``wait`` and ``close`` return."""
        try:
            # What a failure is made of, loaded here, beside the workers' start rather than before
            # it, and before any failure: making one then opens no file (a launcher out of
            # descriptors still reports its workers' failures).
            import relaunch.procs.process_failure  # noqa: F401

            self._watch()
        except BaseException as error:
            self._fail(error)
        finally:
            try:
                self._release()
            finally:
                if not self._ended.is_set():  # _fail itself failed: still end the group
                    with self.lock:
                        self._done = True
                    self._ended.set()

    def _watch(self) -> None:
        while True:
            with self.lock:
                timeout = self._timeout()
            for key, _ in self._selector.select(timeout):
                kind, item = key.data
                if kind == "tee":
                    self._output.pump(item)
                elif kind == "exit":
                    self._reap(item)
                elif kind == "result":
                    self._read_result(item, RESULT_READ_LIMIT)
                else:
                    self._drain_wake()
            self._record_kept()
            copied = self._flush_consoles()
            if self._console is not None:
                self._console.tick()
            if self._past_deadlines():
                return
            if copied:
                time.sleep(COALESCE_SECONDS)

    def _record_kept(self) -> None:
        with self.lock:
            keeping, self._keeping = self._keeping, []
        for worker in keeping:
            if worker.exitcode is None:
                self._stop_watching(worker)
                self._record_exit(worker, 0)

    def _stop_watching(self, worker: WorkerProcess) -> None:
        """``worker`` lives on, but this group is done with it (kept, or given up on): read
        what it wrote (its pipes stay open as long as it lives), and watch it no more."""
        self._unreaped.workers.pop(worker.local_rank, None)
        self._unwatch_exit(worker)
        for stream in worker.streams:
            self._output.pump(stream, until_empty=True)
            if stream.open:
                self._unwatch(stream.read_fd)
                stream.finish()

    def _fail(self, error: BaseException) -> None:
        """The monitor thread fails with ``error``: report it (the agent ends with one line),
        kill the workers, which must not outlive their monitor, and end the group; each step
        runs whatever the one before did. The report comes first, so whoever sees the group end
        never takes it for the workers' own (the agent once read it as a success and sat in the
        exit barrier while its peer waited)."""
        log.debug("the worker monitor failed; stopping the workers", exc_info=error)
        with self.lock:
            self.failure = error if isinstance(error, Exception) else RuntimeError(repr(error))
        try:
            report_failure(threading.current_thread().name, error)
        except Exception:
            log.error("the worker monitor failed: %r", error)
        with self.lock:
            for worker in self.workers.values():
                worker.kept = False  # nobody is left to hand them an attempt
        try:
            self.kill_all_trees()
        finally:
            self._end_without_monitor()

    def _end_without_monitor(self) -> None:
        """The monitor thread failed: reap the killed workers here (each within
        ``KILL_DEADLINE``, else given up) and end the group, which nobody then waits for. A
        worker killed here failed (not in ``stopped_ranks``), so the result never reads as a
        success; one that cannot be built is the monitor's failure (``PContext.wait``)."""
        for worker in self.workers.values():
            if worker.exitcode is not None:
                continue
            try:
                code = worker.handle.wait(KILL_DEADLINE)
            except Exception:
                log.debug("cannot reap local rank %d", worker.local_rank, exc_info=True)
                code = None
            with self.lock:
                worker.exitcode = -signal.SIGKILL if code is None else code
                worker.exit_time = self._clock.time()
        with self.lock:
            self._kill_at = self._give_up_at = self._unreaped.at = None
            done, self._done = self._done, True
        if not done:
            try:
                self._on_done()
            except Exception:
                log.debug("cannot build the result of the group", exc_info=True)
            finally:
                self._ended.set()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _flush_consoles(self) -> bool:
        """Write this round's lines and bars (``OutputRounds.flush``); whether there were any."""
        return self._output.flush()

    def _unwatch(self, fd: int) -> None:
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
            pass  # not watched (any more)

    def _unwatch_exit(self, worker: WorkerProcess) -> None:
        self._unwatch(worker.handle.exit_fd)
        status_fd = worker.handle.status_fd
        if status_fd is not None and status_fd != worker.handle.exit_fd:
            self._unwatch(status_fd)

    def _reap(self, worker: WorkerProcess) -> None:
        if worker.exitcode is not None:
            return  # recorded already (given up on, then looked at again)
        exitcode = worker.handle.poll()
        if exitcode is None:
            self._set_aside(worker)
            return
        self._unreaped.workers.pop(worker.local_rank, None)
        self._unwatch_exit(worker)
        self._record_exit(worker, exitcode)

    def _set_aside(self, worker: WorkerProcess) -> None:
        """Its exit was signalled, yet it cannot be reaped: a zombie that a tracer (a debugger)
        must wait for first, a forkserver that has not reported the status yet, or a zygote
        that has not given it (its status pipe is watched: the handle gives up on the zygote
        in time). Its ready fd would spin the loop: stop watching it and look again after a
        delay that doubles. It ended now, whenever its status comes."""
        if not worker.ended_at:
            worker.ended_at = self._clock.time()
        self._unwatch(worker.handle.exit_fd)
        status_fd = worker.handle.status_fd
        if status_fd is not None and status_fd != worker.handle.exit_fd:
            try:
                self._selector.register(status_fd, selectors.EVENT_READ, ("exit", worker))
            except KeyError:
                pass  # watched already
        self._unreaped.add(worker, self._clock.monotonic())

    def _recheck_unreaped(self) -> None:
        for worker in self._unreaped.take_all():
            self._reap(worker)  # sets it aside again while it still cannot be reaped

    def _record_exit(self, worker: WorkerProcess, exitcode: int) -> None:
        # Whatever the worker wrote before it exited is in its pipes now: read all of it.
        for stream in worker.streams:
            self._output.pump(stream, until_empty=True)
        # All of its return value is in its pipe too: it wrote it before it exited.
        self._read_result(worker, None)
        with self.lock:
            worker.exitcode = exitcode
            worker.exit_time = worker.ended_at or self._clock.time()
            codes = {rank: w.exitcode for rank, w in self.workers.items()}
            state = group_status(codes)
            if self._grace_until is not None and self.grace is not None:
                self.grace.exited(worker.local_rank)
            elif state is GroupStatus.FAILED and self._kill_at is None and not self.holding:
                # The group is one unit: one failure stops the others, once those that save
                # their state when told of it have (``FailureGrace``).
                running = {rank for rank, code in codes.items() if code is None}
                hold = self.grace.begin(running, self.end_grace) if self.grace and running else 0
                if hold > 0:
                    self._grace_until = self._clock.monotonic() + hold
                else:
                    self._stop_locked(signal.SIGTERM, self.stop_timeout)
            if state is GroupStatus.FAILED:
                self._failed.set()
            if all(code is not None for code in codes.values()):
                self._kill_at = self._give_up_at = self._unreaped.at = None
                self._on_done()
                self._done = True
                self._ended.set()

    def _give_up_on_unkillable(self) -> None:
        """``KILL_DEADLINE`` s after SIGKILL: log each worker still not reaped with its state,
        list it in ``stuck``, keep what it wrote, and let the group end without it."""
        with self.lock:
            self._give_up_at = None
        for worker in list(self.workers.values()):
            if worker.exitcode is not None:
                continue
            if worker.handle.poll() is not None:
                self._reap(worker)  # it went just now
                continue
            stuck = stuck_worker(worker.pid)
            log.warning(
                "local rank %d did not die within %gs of SIGKILL: %s; going on without it",
                worker.local_rank,
                KILL_DEADLINE,
                stuck,
            )
            self._stop_watching(worker)
            worker.handle.abandon()
            with self.lock:
                self.stuck[worker.local_rank] = stuck
            self._record_exit(worker, -signal.SIGKILL)

    def _read_result(self, worker: WorkerProcess, limit: int | None) -> None:
        """Read what arrived of ``worker``'s return value (at most ``limit`` bytes; None: all
        there is, the worker having exited); stop watching the pipe once nothing more comes."""
        reader = worker.result
        if reader is None or reader.fd < 0:
            return
        if reader.read(limit or sys.maxsize) or limit is None:
            self._unwatch(reader.fd)
            reader.close()

    def _past_deadlines(self) -> bool:
        now = self._clock.monotonic()
        if self._unreaped.at is not None and now >= self._unreaped.at:
            self._recheck_unreaped()
        with self.lock:
            if self._grace_until is not None and now >= self._grace_until:
                self._stop_locked(signal.SIGTERM, self.stop_timeout)
            if self._kill_at is not None and now >= self._kill_at:
                self._kill_at = None
                log.warning("workers did not exit in time after the stop signal: sending SIGKILL")
                for worker in self.workers.values():
                    if not worker.kept:
                        signal_tree(worker.pid, signal.SIGKILL)
                self._give_up_after_kill()
            give_up = self._give_up_at is not None and now >= self._give_up_at
        if give_up:
            self._give_up_on_unkillable()
        with self.lock:
            if not (self._finishing and self._done):
                return False
            streams_open = any(s.open for w in self.workers.values() for s in w.streams)
            return not streams_open or (self._drain_until is not None and now >= self._drain_until)

    def _release(self) -> None:
        if self._console is not None:
            self._console.remove_waker(self._wake)
        try:
            self._flush_consoles()
        except Exception:
            if self.failure is None:
                raise  # reported by ``start_thread``, once the rest is released
            # The same failure again (reported already): release the rest regardless.
            log.debug("could not write the workers' last output", exc_info=True)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        self._selector.close()
        for worker in self.workers.values():
            for stream in worker.streams:
                if stream.open:
                    stream.pump(until_empty=True)
                    stream.finish()
            if worker.result is not None:
                worker.result.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
