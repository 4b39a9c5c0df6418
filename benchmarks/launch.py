"""Side by side: the ``relaunch`` command against ``torchrun`` and a plain-``Popen`` floor.

Run by hand (not part of the test suite): ``python -m benchmarks launch [--quick]``.

Four measurements, each run under relaunch and, where ``torch`` can be imported, under torchrun
(``python -m torch.distributed.run``) in the same run, alternating: start-up wall time against
the floor, the launcher's own peak RSS, failure to the restarted worker's first line, and
SIGTERM to launcher exit. Only relaunch's numbers are checked against budgets; torchrun's are
for comparison. Standard library only; the exit status is 0 when every relaunch budget was
measured and holds. See benchmarks/README.md for what each measurement means.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median, verdict

STARTUP_NPROCS = (1, 2, 4, 8, 16, 32)
STARTUP_BUDGET_S = 0.15  # relaunch wall time <= floor + this
RSS_WORKERS = 8
RSS_BUDGET_MIB = 40.0
RESTART_BUDGET_MS = 120.0  # median, failure -> the restarted worker's line at the benchmark
STOP_WORKERS = 4
STOP_BUDGET_MS = 200.0  # median, SIGTERM -> launcher exited
STOP_EXIT_CODE = 128 + signal.SIGTERM
LINE_TIMEOUT_S = 60.0  # give up on a launcher that prints nothing for this long

FLOOR = "floor"


STARTED_RE = re.compile(rb"started (\d+(?:\.\d+)?)")


@dataclass
class Launcher(harness.Launcher):
    """A launcher command line; ``flags`` are torchrun's, passed to both launchers as they are."""

    _probed: dict[tuple[str, ...], str | None] = field(default_factory=dict)


@dataclass
class Bench(harness.Bench[Launcher]):
    """Shared state (see harness.Bench), and what was left behind."""

    leftovers: list[str] = field(default_factory=list)

    def stderr_file(self) -> str:
        return os.path.join(self.tmp, "launcher-stderr.txt")

    def stderr_tail(self) -> str:
        return harness.last_line(self.stderr_file())

    def popen(
        self, argv: list[str], stdout: int | None = subprocess.DEVNULL
    ) -> subprocess.Popen[bytes]:
        with open(self.stderr_file(), "wb") as err:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=err,
                env=self.env,
                cwd=self.tmp,
            )

    def usable(self, launcher: Launcher, flags: Sequence[str]) -> str | None:
        """None if ``launcher FLAGS noop.py`` exits 0, else why not (the result is cached)."""
        if launcher.unavailable is not None:
            return launcher.unavailable
        key = tuple(flags)
        if key not in launcher._probed:
            try:
                proc = self.popen(launcher.argv(flags, self.script("noop.py")))
            except OSError as exc:
                launcher.unavailable = f"cannot start {launcher.prefix[0]!r}: {exc.strerror}"
                log(f"  {launcher.name}: {launcher.unavailable}")
                return launcher.unavailable
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                harness.kill_pid(proc.pid)
                code = proc.wait()
            reason = None if code == 0 else f"exit {code}: {self.stderr_tail()}"
            launcher._probed[key] = reason
            if reason is not None:
                log(f"  {launcher.name} cannot run {' '.join(flags)}: {reason}")
        return launcher._probed[key]


# -- processes ---------------------------------------------------------------------------------


class Lines:
    """Lines from a pipe, each stamped with time.time() when its chunk arrived."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.partial = b""
        self.ready: list[tuple[float, bytes]] = []
        self.eof = False

    def next(self, timeout: float = LINE_TIMEOUT_S) -> tuple[float, bytes] | None:
        """The next whole line, or None at end of file or after ``timeout`` s of silence."""
        while not self.ready and not self.eof:
            if not select.select([self.fd], [], [], timeout)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            arrival = time.time()
            if not chunk:
                self.eof = True
                break
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            self.ready.extend((arrival, line) for line in lines)
        return self.ready.pop(0) if self.ready else None


def finish(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int:
    """Wait for a launcher; SIGKILL it (by pid) if it hangs."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        harness.kill_pid(proc.pid)
        proc.wait()
        raise BenchError(f"launcher did not exit within {timeout:.0f} s; killed") from None
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


# -- 1. start-up -------------------------------------------------------------------------------


def startup_launcher(bench: Bench, launcher: Launcher, nprocs: int) -> float:
    flags = ("--standalone", "--nproc-per-node", str(nprocs))
    argv = launcher.argv(flags, bench.script("noop.py"))
    started = time.perf_counter()
    proc = bench.popen(argv)
    code = proc.wait()
    elapsed = time.perf_counter() - started
    if code != 0:
        raise BenchError(f"exit {code}: {bench.stderr_tail()}")
    return elapsed


def startup_floor(bench: Bench, nprocs: int) -> float:
    argv = [sys.executable, "-u", bench.script("noop.py")]
    started = time.perf_counter()
    procs = [bench.popen(argv) for _ in range(nprocs)]
    codes = [proc.wait() for proc in procs]
    elapsed = time.perf_counter() - started
    if any(codes):
        raise BenchError(f"floor exit codes {codes}")
    return elapsed


def bench_startup(
    bench: Bench,
    reps: int,
    torchrun_reps: int,
    big_reps: int,
    nprocs_list: Sequence[int] = STARTUP_NPROCS,
) -> list[Check]:
    log(
        f"[1/4] start-up: N in {tuple(nprocs_list)}, {reps} repetitions (torchrun: {torchrun_reps},"
        f" {big_reps} at N >= 16), alternating"
    )
    probe = ("--standalone", "--nproc-per-node", "1")
    usable = [lch for lch in bench.launchers() if bench.usable(lch, probe) is None]
    rows = []
    errors: dict[str, str] = {}
    for nprocs in nprocs_list:
        log(f"  N={nprocs}")
        sides: dict[str, Callable[..., Any]] = {
            FLOOR: lambda _rep, n=nprocs: startup_floor(bench, n)
        }
        for lch in usable:
            sides[lch.name] = lambda _rep, lch=lch, n=nprocs: startup_launcher(bench, lch, n)
        counts = {side: reps for side in sides}
        if TORCHRUN in counts:
            counts[TORCHRUN] = torchrun_reps if nprocs <= 8 else big_reps
        samples = harness.run_alternating(
            sides, counts, errors, bench.collect, warmup=nprocs == nprocs_list[0]
        )
        rows.append((nprocs, {side: [x * 1e3 for x in runs] for side, runs in samples.items()}))

    print("\n1. start-up: launcher --standalone --nproc-per-node N noop.py, wall time, medians;")
    print("   +ms: median over repetitions of (launcher - floor) within the same repetition")
    print(
        f"{'N':>4} {'floor ms':>9} {'relaunch ms':>12} {'+ms':>7}  <= +150 {'torchrun ms':>12}"
        f" {'+ms':>7} {'torchrun/relaunch':>18}"
    )
    checks = []
    for nprocs, runs in rows:
        floor, ours, theirs = (
            median(runs[s]) if s in runs else None for s in (FLOOR, RELAUNCH, TORCHRUN)
        )
        extra = paired_extra(runs.get(RELAUNCH), runs.get(FLOOR))
        their_extra = paired_extra(runs.get(TORCHRUN), runs.get(FLOOR))
        ok = None if extra is None or extra != extra else extra <= STARTUP_BUDGET_S * 1e3
        ratio = None if ours is None or theirs is None else theirs / ours
        print(
            f"{nprocs:>4} {fmt(floor):>9} {fmt(ours):>12} {fmt(extra, '+.1f'):>7}  "
            f"{verdict(ok):>6} {fmt(theirs):>12} {fmt(their_extra, '+.1f'):>7}"
            f" {fmt(ratio, '.2f'):>18}"
        )
        checks.append(
            Check(
                f"start-up N={nprocs}: relaunch - floor",
                f"{fmt(extra, '+.1f')} ms",
                f"<= +{STARTUP_BUDGET_S * 1e3:.0f} ms",
                ok,
            )
        )
    note_unusable(bench, probe, errors)
    return checks


def paired_extra(side: list[float] | None, floor: list[float] | None) -> float | None:
    """Median of side[i] - floor[i]: the two ran back to back, so slow spells cancel out."""
    if not side or not floor:
        return None
    return median([a - b for a, b in zip(side, floor, strict=False)])


def note_unusable(bench: Bench, flags: Sequence[str], errors: dict[str, str]) -> None:
    for lch in bench.launchers():
        reason = bench.usable(lch, flags) or errors.get(lch.name)
        if reason is not None:
            print(f"  {lch.name}: not measured ({reason})")


# -- 2. peak RSS -------------------------------------------------------------------------------


def vm_hwm_kib(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def rss_run(bench: Bench, launcher: Launcher) -> tuple[float, float]:
    """(VmHWM sampled every 5 ms, ru_maxrss from wait4) of the launcher process, in MiB."""
    flags = ("--standalone", "--nproc-per-node", str(RSS_WORKERS))
    proc = bench.popen(launcher.argv(flags, bench.script("sleep.py")))
    hwm = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        hwm = max(hwm, vm_hwm_kib(proc.pid))
        time.sleep(0.005)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise BenchError(f"exit {proc.returncode}: {bench.stderr_tail()}")
    return hwm / 1024, usage.ru_maxrss / 1024


def bench_rss(bench: Bench, reps: int) -> list[Check]:
    log(f"[2/4] peak RSS: {RSS_WORKERS} workers sleeping 1 s, {reps} repetitions")
    probe = ("--standalone", "--nproc-per-node", "1")
    sides: dict[str, Callable[..., Any]] = {
        lch.name: lambda _rep, lch=lch: rss_run(bench, lch)
        for lch in bench.launchers()
        if bench.usable(lch, probe) is None
    }
    errors: dict[str, str] = {}
    samples = harness.run_alternating(sides, dict.fromkeys(sides, reps), errors, bench.collect)
    print(f"\n2. launcher's own peak RSS, {RSS_WORKERS} workers sleeping 1 s, medians")
    print(f"{'launcher':<9} {'runs':>4} {'VmHWM MiB':>10} {'ru_maxrss MiB':>14}  <= 40 MiB")
    checks = []
    for name in (RELAUNCH, TORCHRUN):
        runs = samples.get(name, [])
        hwm = median([r[0] for r in runs]) if runs else None
        maxrss = median([r[1] for r in runs]) if runs else None
        ok = None
        if name == RELAUNCH and hwm is not None and maxrss is not None:
            ok = max(hwm, maxrss) <= RSS_BUDGET_MIB
        shown = verdict(ok) if name == RELAUNCH else ""
        print(f"{name:<9} {len(runs):>4} {fmt(hwm):>10} {fmt(maxrss):>14}  {shown}")
        if name == RELAUNCH:
            peak = None if hwm is None or maxrss is None else max(hwm, maxrss)
            checks.append(
                Check(
                    f"peak RSS, {RSS_WORKERS} workers",
                    f"{fmt(peak)} MiB",
                    f"<= {RSS_BUDGET_MIB:.0f} MiB",
                    ok,
                )
            )
    note_unusable(bench, probe, errors)
    return checks


# -- 3. failure -> restarted worker's first line -----------------------------------------------


def restart_run(bench: Bench, launcher: Launcher, rep: int) -> tuple[float, float]:
    """(own start - failure, arrival - failure) in ms for one failure and restart."""
    stamp = os.path.join(bench.tmp, f"failed-{launcher.name}-{rep}.txt")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stamp)
    flags = ("--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--tee", "3")
    proc = bench.popen(launcher.argv(flags, bench.script("restart.py"), stamp), subprocess.PIPE)
    assert proc.stdout is not None
    lines = Lines(proc.stdout.fileno())
    found: tuple[float, float] | None = None
    while (item := lines.next()) is not None:
        match = STARTED_RE.search(item[1])
        if match and found is None:
            found = (item[0], float(match.group(1)))
    code = finish(proc)
    if found is None:
        raise BenchError(
            f"no 'started' line from a restarted worker (exit {code}: {bench.stderr_tail()})"
        )
    if code != 0:
        raise BenchError(f"exit {code} after the restart: {bench.stderr_tail()}")
    try:
        with open(stamp) as file:
            failed = float(file.read())
    except (OSError, ValueError) as exc:
        raise BenchError(f"a worker started without a failed first attempt ({exc})") from None
    arrival, started = found
    return (started - failed) * 1e3, (arrival - failed) * 1e3


def bench_restart(bench: Bench, reps: int) -> list[Check]:
    log(f"[3/4] failure -> restarted worker's first line: {reps} repetitions")
    probe = ("--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--tee", "3")
    counter = iter(range(1 << 30))
    sides: dict[str, Callable[..., Any]] = {
        lch.name: lambda _rep, lch=lch: restart_run(bench, lch, next(counter))
        for lch in bench.launchers()
        if bench.usable(lch, probe) is None
    }
    errors: dict[str, str] = {}
    samples = harness.run_alternating(sides, dict.fromkeys(sides, reps), errors, bench.collect)
    print("\n3. failure -> restarted worker (--max-restarts 1 --tee 3), ms, median [min-max]")
    print(
        f"{'launcher':<9} {'runs':>4} {'own start - failure':>22} {'arrival - failure':>22}"
        "  <= 120 ms"
    )
    checks = []
    for name in (RELAUNCH, TORCHRUN):
        runs = samples.get(name, [])
        cols = []
        for i in (0, 1):
            values = [r[i] for r in runs]
            cols.append(
                f"{median(values):.1f} [{min(values):.0f}-{max(values):.0f}]" if values else "-"
            )
        arrival = median([r[1] for r in runs]) if runs else None
        ok = None if name != RELAUNCH or arrival is None else arrival <= RESTART_BUDGET_MS
        shown = verdict(ok) if name == RELAUNCH else ""
        print(f"{name:<9} {len(runs):>4} {cols[0]:>22} {cols[1]:>22}  {shown}")
        if name == RELAUNCH:
            checks.append(
                Check(
                    "failure -> restarted line (arrival)",
                    f"{fmt(arrival)} ms",
                    f"<= {RESTART_BUDGET_MS:.0f} ms",
                    ok,
                )
            )
    note_unusable(bench, probe, errors)
    return checks


# -- 4. SIGTERM -> launcher gone ---------------------------------------------------------------


@dataclass
class StopRun:
    ms: float
    code: int
    workers: int  # pid files found
    alive_at_exit: int  # workers still running when the launcher had exited
    killed: int  # of those, still running 1 s later (killed by the benchmark)


def worker_pids(pid_dir: str) -> list[int]:
    return [int(name.split(".")[0]) for name in os.listdir(pid_dir) if name.endswith(".pid")]


def stop_run(bench: Bench, launcher: Launcher, rep: int) -> StopRun:
    pid_dir = tempfile.mkdtemp(prefix=f"pids-{launcher.name}-{rep}-", dir=bench.tmp)
    flags = ("--standalone", "--nproc-per-node", str(STOP_WORKERS), "--tee", "3")
    proc = bench.popen(launcher.argv(flags, bench.script("ready.py"), pid_dir), subprocess.PIPE)
    assert proc.stdout is not None
    lines, ready = Lines(proc.stdout.fileno()), 0
    try:
        while ready < STOP_WORKERS:
            item = lines.next()
            if item is None:
                raise BenchError(
                    f"{ready} of {STOP_WORKERS} workers ready, then "
                    f"{'end of output' if lines.eof else 'silence'}"
                )
            ready += b"ready" in item[1]
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        elapsed = time.perf_counter() - started
    except (BenchError, subprocess.TimeoutExpired) as exc:
        harness.kill_pid(proc.pid)
        proc.wait()
        for pid in worker_pids(pid_dir):
            if harness.alive(pid):
                harness.kill_pid(pid)
        raise BenchError(f"{exc}: {bench.stderr_tail()}") from None
    finally:
        proc.stdout.close()
    pids = worker_pids(pid_dir)
    at_exit = [pid for pid in pids if harness.alive(pid)]
    deadline = time.monotonic() + 1.0
    while (
        survivors := [pid for pid in at_exit if harness.alive(pid)]
    ) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in survivors:
        bench.leftovers.append(f"pid {pid}: {launcher.name} worker alive 1 s after SIGTERM")
        harness.kill_pid(pid)
    return StopRun(elapsed * 1e3, code, len(pids), len(at_exit), len(survivors))


def bench_stop(bench: Bench, reps: int) -> list[Check]:
    log(f"[4/4] SIGTERM -> launcher exited: {STOP_WORKERS} workers, {reps} repetitions")
    probe = ("--standalone", "--nproc-per-node", "1", "--tee", "3")
    counter = iter(range(1 << 30))
    sides: dict[str, Callable[..., Any]] = {
        lch.name: lambda _rep, lch=lch: stop_run(bench, lch, next(counter))
        for lch in bench.launchers()
        if bench.usable(lch, probe) is None
    }
    errors: dict[str, str] = {}
    samples = harness.run_alternating(sides, dict.fromkeys(sides, reps), errors, bench.collect)
    print(f"\n4. SIGTERM -> launcher exited, {STOP_WORKERS} workers sleeping, ms")
    print(
        f"{'launcher':<9} {'runs':>4} {'median':>7} {'max':>7} {'exit codes':>11}"
        f" {'alive at exit':>14} {'killed':>7}  <= 200 ms, exit 143, workers gone"
    )
    checks = []
    for name in (RELAUNCH, TORCHRUN):
        runs: list[StopRun] = samples.get(name, [])
        med = median([r.ms for r in runs]) if runs else None
        codes = ",".join(sorted({str(r.code) for r in runs})) or "-"
        at_exit = sum(r.alive_at_exit for r in runs)
        killed = sum(r.killed for r in runs)
        ok = None
        if name == RELAUNCH and med is not None:
            ok = (
                med <= STOP_BUDGET_MS
                and all(r.code == STOP_EXIT_CODE for r in runs)
                and at_exit == 0
                and all(r.workers == STOP_WORKERS for r in runs)
            )
        shown = verdict(ok) if name == RELAUNCH else ""
        worst = max((r.ms for r in runs), default=None)
        print(
            f"{name:<9} {len(runs):>4} {fmt(med):>7} {fmt(worst):>7} {codes:>11}"
            f" {at_exit:>14} {killed:>7}  {shown}"
        )
        if name == RELAUNCH:
            checks.append(
                Check(
                    "SIGTERM -> exited (exit 143, workers gone)",
                    f"{fmt(med)} ms",
                    f"<= {STOP_BUDGET_MS:.0f} ms",
                    ok,
                )
            )
    note_unusable(bench, probe, errors)
    return checks


# -- main --------------------------------------------------------------------------------------


QUICK = {
    "reps": 2,
    "startup_reps": 2,
    "startup_torchrun_reps": 1,
    "startup_torchrun_big_reps": 1,
    "rss_reps": 1,
    "nprocs": [1, 8],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=5, help="restart and stop repetitions")
    parser.add_argument(
        "--startup-reps", type=int, default=7, help="start-up repetitions of floor and relaunch"
    )
    parser.add_argument(
        "--startup-torchrun-reps", type=int, default=5, help="start-up torchrun reps at N <= 8"
    )
    parser.add_argument(
        "--startup-torchrun-big-reps", type=int, default=3, help="start-up torchrun reps at N >= 16"
    )
    parser.add_argument(
        "--nprocs",
        type=int,
        nargs="+",
        default=list(STARTUP_NPROCS),
        help="start-up: workers per run (default: %(default)s)",
    )
    parser.add_argument("--rss-reps", type=int, default=3, help="repetitions of the RSS test")
    parser.add_argument(
        "--only",
        action="append",
        choices=("startup", "rss", "restart", "stop"),
        help="run only these measurements (repeatable)",
    )


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    only = set(opts.only or ("startup", "rss", "restart", "stop"))
    relaunch, torchrun = ctx.launchers(Launcher)
    bench = ctx.bench(Bench, relaunch, torchrun)
    checks: list[Check] = []
    if "startup" in only:
        checks += bench_startup(
            bench,
            opts.startup_reps,
            opts.startup_torchrun_reps,
            opts.startup_torchrun_big_reps,
            opts.nprocs,
        )
    if "rss" in only:
        checks += bench_rss(bench, opts.rss_reps)
    if "restart" in only:
        checks += bench_restart(bench, opts.reps)
    if "stop" in only:
        checks += bench_stop(bench, opts.reps)
    return checks
