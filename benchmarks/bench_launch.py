"""Side by side: the ``relaunch`` command against ``torchrun`` and a plain-``Popen`` floor.

Run by hand (not part of the test suite)::

    python benchmarks/bench_launch.py

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
import ctypes
import os
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

STARTUP_NPROCS = (1, 2, 4, 8, 16, 32)
STARTUP_BUDGET_S = 0.15  # relaunch wall time <= floor + this
RSS_WORKERS = 8
RSS_BUDGET_MIB = 40.0
RESTART_BUDGET_MS = 120.0  # median, failure -> the restarted worker's line at the benchmark
STOP_WORKERS = 4
STOP_BUDGET_MS = 200.0  # median, SIGTERM -> launcher exited
STOP_EXIT_CODE = 128 + signal.SIGTERM
LINE_TIMEOUT_S = 60.0  # give up on a launcher that prints nothing for this long

RELAUNCH = "relaunch"
TORCHRUN = "torchrun"
FLOOR = "floor"

#: The worker scripts, written to a temporary directory; both launchers run them as
#: ``python -u SCRIPT ARGS``.
SCRIPTS = {
    "noop.py": "pass\n",
    "sleep1.py": "import time\ntime.sleep(1.0)\n",
    # First attempt: no output, stamp the failure time, exit 1 at once. Restart: print a line.
    "restart.py": """\
import os, sys, time
if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    with open(sys.argv[1], "w") as file:
        file.write(repr(time.time()))
    os._exit(1)
print(f"started {time.time()!r}", flush=True)
""",
    # Record the pid, say ready, then sleep until stopped.
    "ready.py": """\
import os, sys, time
with open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w") as file:
    file.write(str(os.getpid()))
print("ready", flush=True)
while True:
    time.sleep(3600)
""",
}

STARTED_RE = re.compile(rb"started (\d+(?:\.\d+)?)")


class BenchError(Exception):
    """One run of one side went wrong; that side is dropped from the measurement."""


# -- helpers -----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def verdict(ok: bool | None) -> str:
    return "SKIP" if ok is None else ("PASS" if ok else "FAIL")


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or value != value else format(value, spec)


@dataclass
class Check:
    what: str
    measured: str
    budget: str
    ok: bool | None  # None: not measured


@dataclass
class Launcher:
    """A launcher command line; ``flags`` are torchrun's, passed to both launchers as they are."""

    name: str
    prefix: list[str]
    unavailable: str | None = None  # why it cannot run at all
    _probed: dict[tuple[str, ...], str | None] = field(default_factory=dict)

    def argv(self, flags: Sequence[str], script: str, *args: str) -> list[str]:
        return [*self.prefix, *flags, script, *args]


@dataclass
class Bench:
    """Shared state: the temporary directory, the environment, what was left behind."""

    tmp: str
    env: dict[str, str]
    relaunch: Launcher
    torchrun: Launcher
    leftovers: list[str] = field(default_factory=list)

    def script(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def launchers(self) -> list[Launcher]:
        return [self.relaunch, self.torchrun]

    def stderr_file(self) -> str:
        return os.path.join(self.tmp, "launcher-stderr.txt")

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError), open(self.stderr_file(), errors="replace") as file:
            lines = [line.strip() for line in file if line.strip()]
            return lines[-1][:160] if lines else "(no stderr)"
        return "(no stderr)"

    def popen(self, argv: list[str], stdout: int | None = subprocess.DEVNULL) -> subprocess.Popen:
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
                kill_pid(proc.pid)
                code = proc.wait()
            reason = None if code == 0 else f"exit {code}: {self.stderr_tail()}"
            launcher._probed[key] = reason
            if reason is not None:
                log(f"  {launcher.name} cannot run {' '.join(flags)}: {reason}")
        return launcher._probed[key]


# -- processes: orphans, liveness, clean-up ----------------------------------------------------


def become_subreaper() -> bool:
    """Adopt our launchers' orphans (prctl PR_SET_CHILD_SUBREAPER) so that none escapes us."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone); reaps it if it is our zombie."""
    stat = proc_stat(pid)
    if stat is None:
        return False
    if stat[0] in "ZX":
        if stat[1] == os.getpid():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        return False
    return True


def our_children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat[1] == me:
                found.append(int(entry))
    return found


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def collect_orphans(bench: Bench, grace: float = 3.0) -> None:
    """Call with no launcher running: every child of ours now is an adopted orphan. Reap those
    that exit within ``grace`` (relaunch's guardian exits when its launcher has); kill the rest,
    by pid, and report them."""
    deadline = time.monotonic() + grace
    while True:
        live = [pid for pid in our_children() if alive(pid)]
        if not live:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for pid in live:
        stat = proc_stat(pid)
        cmd = "?"
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as file:
            cmd = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        bench.leftovers.append(f"pid {pid} ({stat[0] if stat else '?'}) {cmd[:80]}")
        kill_pid(pid)
    time.sleep(0.05)
    for pid in live:
        alive(pid)  # reaps the zombie


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


def finish(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """Wait for a launcher; SIGKILL it (by pid) if it hangs."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_pid(proc.pid)
        proc.wait()
        raise BenchError(f"launcher did not exit within {timeout:.0f} s; killed") from None
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


def alternate(sides: list[str], rep: int) -> list[str]:
    """Rotate the order each repetition, so that no side always runs first."""
    k = rep % len(sides) if sides else 0
    return sides[k:] + sides[:k]


def run_alternating(
    sides: dict[str, Callable[[], float | tuple[float, ...]]],
    reps: dict[str, int],
    bench: Bench,
    errors: dict[str, str],
    warmup: bool = True,
) -> dict[str, list]:
    """``reps[side]`` runs of each side, interleaved, after one untimed run of each (unless
    ``warmup`` is false); a side that fails once is dropped."""
    samples: dict[str, list] = {side: [] for side in sides}
    first = -1 if warmup else 0
    for rep in range(first, max(reps.values(), default=0)):
        for side in alternate(list(sides), rep):
            if side in errors or len(samples[side]) >= reps[side]:
                continue
            try:
                result = sides[side]()
                if rep >= 0:
                    samples[side].append(result)
            except BenchError as exc:
                errors[side] = str(exc)
                log(f"  {side}: {exc}")
            collect_orphans(bench)
    return samples


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


def bench_startup(bench: Bench, reps: int, torchrun_reps: int, big_reps: int) -> list[Check]:
    log(
        f"[1/4] start-up: N in {STARTUP_NPROCS}, {reps} repetitions (torchrun: {torchrun_reps},"
        f" {big_reps} at N >= 16), alternating"
    )
    probe = ("--standalone", "--nproc-per-node", "1")
    usable = [lch for lch in bench.launchers() if bench.usable(lch, probe) is None]
    rows = []
    errors: dict[str, str] = {}
    for nprocs in STARTUP_NPROCS:
        log(f"  N={nprocs}")
        sides: dict[str, Callable[[], float | tuple[float, ...]]] = {
            FLOOR: lambda n=nprocs: startup_floor(bench, n)
        }
        for lch in usable:
            sides[lch.name] = lambda lch=lch, n=nprocs: startup_launcher(bench, lch, n)
        counts = {side: reps for side in sides}
        if TORCHRUN in counts:
            counts[TORCHRUN] = torchrun_reps if nprocs <= 8 else big_reps
        samples = run_alternating(sides, counts, bench, errors, warmup=nprocs == 1)
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
    proc = bench.popen(launcher.argv(flags, bench.script("sleep1.py")))
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
    sides: dict[str, Callable[[], float | tuple[float, ...]]] = {
        lch.name: lambda lch=lch: rss_run(bench, lch)
        for lch in bench.launchers()
        if bench.usable(lch, probe) is None
    }
    errors: dict[str, str] = {}
    samples = run_alternating(sides, dict.fromkeys(sides, reps), bench, errors)
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
    sides: dict[str, Callable[[], float | tuple[float, ...]]] = {
        lch.name: lambda lch=lch: restart_run(bench, lch, next(counter))
        for lch in bench.launchers()
        if bench.usable(lch, probe) is None
    }
    errors: dict[str, str] = {}
    samples = run_alternating(sides, dict.fromkeys(sides, reps), bench, errors)
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
        kill_pid(proc.pid)
        proc.wait()
        for pid in worker_pids(pid_dir):
            if alive(pid):
                kill_pid(pid)
        raise BenchError(f"{exc}: {bench.stderr_tail()}") from None
    finally:
        proc.stdout.close()
    pids = worker_pids(pid_dir)
    at_exit = [pid for pid in pids if alive(pid)]
    deadline = time.monotonic() + 1.0
    while (survivors := [pid for pid in at_exit if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in survivors:
        bench.leftovers.append(f"pid {pid}: {launcher.name} worker alive 1 s after SIGTERM")
        kill_pid(pid)
    return StopRun(elapsed * 1e3, code, len(pids), len(at_exit), len(survivors))


def bench_stop(bench: Bench, reps: int) -> list[Check]:
    log(f"[4/4] SIGTERM -> launcher exited: {STOP_WORKERS} workers, {reps} repetitions")
    probe = ("--standalone", "--nproc-per-node", "1", "--tee", "3")
    counter = iter(range(1 << 30))
    sides: dict[str, Callable[[], float | tuple[float, ...]]] = {
        lch.name: lambda lch=lch: stop_run(bench, lch, next(counter))
        for lch in bench.launchers()
        if bench.usable(lch, probe) is None
    }
    errors: dict[str, str] = {}
    samples = run_alternating(sides, dict.fromkeys(sides, reps), bench, errors)
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


@contextlib.contextmanager
def bench_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="relaunch-bench-launch-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def load_average() -> str:
    with contextlib.suppress(OSError), open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])
    return "?"


def relaunch_source() -> str:
    """Where ``import relaunch`` comes from, with the git state of that tree when there is one."""
    probe = subprocess.run(
        [sys.executable, "-c", "import relaunch; print(relaunch.__file__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return "import relaunch fails"
    package = os.path.dirname(probe.stdout.strip())
    try:
        git = subprocess.run(
            ["git", "-C", package, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return package
    return package + (f", git {git.stdout.strip()}" if git.returncode == 0 else "")


def find_torchrun(prefix: list[str]) -> str | None:
    """None when the torchrun command is usable; else why not."""
    if prefix[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
        if probe.returncode != 0:
            return "import torch fails"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--rss-reps", type=int, default=3, help="repetitions of the RSS test")
    parser.add_argument(
        "--only",
        action="append",
        choices=("startup", "rss", "restart", "stop"),
        help="run only these measurements (repeatable)",
    )
    parser.add_argument("--no-torchrun", action="store_true", help="measure relaunch only")
    parser.add_argument(
        "--relaunch",
        default=f"{shlex.quote(sys.executable)} -m relaunch",
        help="the relaunch command (default: %(default)s)",
    )
    parser.add_argument(
        "--torchrun",
        default=f"{shlex.quote(sys.executable)} -m torch.distributed.run",
        help="the torchrun command (default: %(default)s)",
    )
    parser.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="run with the environment's bytecode settings as they are",
    )
    opts = parser.parse_args()
    only = set(opts.only or ("startup", "rss", "restart", "stop"))

    subreaper = become_subreaper()
    started = time.perf_counter()
    with bench_dir() as tmp:
        for name, text in SCRIPTS.items():
            with open(os.path.join(tmp, name), "w") as file:
                file.write(text)
        os.mkdir(os.path.join(tmp, "tmp"))
        # Same environment for every side. TMPDIR keeps the launchers' log directories inside
        # ours; PYTHONUNBUFFERED makes torchrun's tee reach a pipe at once, as on a terminal.
        env = {**os.environ, "TMPDIR": os.path.join(tmp, "tmp"), "PYTHONUNBUFFERED": "1"}
        if not opts.no_bytecode_cache:
            # Cache bytecode as an installed package would, even where PYTHONDONTWRITEBYTECODE
            # is set and the sources have no __pycache__ (an editable install): in a tree of
            # our own, so that nothing is written next to the sources. The warm-up runs fill it.
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        torchrun_prefix = shlex.split(opts.torchrun)
        relaunch = Launcher(RELAUNCH, shlex.split(opts.relaunch))
        torchrun = Launcher(
            TORCHRUN,
            torchrun_prefix,
            unavailable="--no-torchrun" if opts.no_torchrun else find_torchrun(torchrun_prefix),
        )
        bench = Bench(tmp, env, relaunch, torchrun)
        print(
            f"bench_launch: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
            f"{time.strftime('%Y-%m-%d')}"
        )
        print(f"  relaunch: {opts.relaunch} ({relaunch_source()})")
        print(
            f"  torchrun: {opts.torchrun}"
            + (f" (not run: {torchrun.unavailable})" if torchrun.unavailable else "")
        )
        bytecode = "as the environment has it" if opts.no_bytecode_cache else "cached (own prefix)"
        print(f"  bytecode: {bytecode}")
        print(f"  load average: {load_average()}")
        if not subreaper:
            print("  note: not a child subreaper; orphans of a launcher cannot be checked")
        checks: list[Check] = []
        if "startup" in only:
            checks += bench_startup(
                bench, opts.startup_reps, opts.startup_torchrun_reps, opts.startup_torchrun_big_reps
            )
        if "rss" in only:
            checks += bench_rss(bench, opts.rss_reps)
        if "restart" in only:
            checks += bench_restart(bench, opts.reps)
        if "stop" in only:
            checks += bench_stop(bench, opts.reps)
        collect_orphans(bench)

    leftovers = bench.leftovers
    checks.append(Check("processes left behind", str(len(leftovers)), "0", not leftovers))
    print("\nsummary (budgets apply to relaunch)")
    width = max(len(check.what) for check in checks)
    mwidth = max(len(check.measured) for check in checks)
    bwidth = max(len(check.budget) for check in checks)
    for check in checks:
        print(
            f"  {check.what:<{width}}  {check.measured:>{mwidth}}  {check.budget:>{bwidth}}"
            f"  {verdict(check.ok)}"
        )
    for leftover in leftovers:
        print(f"  left behind (killed): {leftover}")
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0 if all(check.ok for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
