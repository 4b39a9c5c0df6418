"""Benchmarks of ``relaunch.start_processes``: start-up overhead, tee throughput, line latency.

Run by hand (not part of the test suite): ``python -m benchmarks procs [--quick]``.

Standard library only. Every number is compared with a floor that does the same work without
relaunch, and checked against the budget it was given; the exit status is 0 when every budget
holds. See benchmarks/README.md for what each measurement means.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import harness
from benchmarks.harness import Check, log, temp_dir, verdict
from relaunch import Std, start_processes

STARTUP_NPROCS = (1, 2, 4, 8, 16, 32)
STARTUP_BUDGET = 1.2  # relaunch / floor
TEE_BUDGET = 1.3  # tee / redirect
LATENCY_P50_BUDGET_MS = 2.0
LATENCY_P99_BUDGET_MS = 20.0

#: A worker that does nothing: the same command on both sides of the start-up comparison.
NOOP_ARGS = ("-S", "-c", "pass")

#: Worker programs (benchmarks/workers): lines for the tee test, stamped lines for the latency
#: test (run with ``-u``: each ``write`` is one ``write(2)`` of one whole line), and the
#: launcher of the latency test, a child of the benchmark whose stdout is a pipe.
PRINT_LINES = harness.worker("print_lines.py")
STAMPED_LINES = harness.worker("stamped_lines.py")
TEE_LATENCY = harness.worker("tee_latency.py")

#: The leak mark of this run (``run`` sets it): in every worker's environment.
MARK: dict[str, str] = {}


def expected_line(i: int) -> bytes:
    return f"line {i} some payload text\n".encode()


# -- helpers -----------------------------------------------------------------------------------


def fresh_log_dir() -> contextlib.AbstractContextManager[str]:
    return temp_dir("relaunch-bench-")


@contextlib.contextmanager
def stdout_to(path: str) -> Iterator[None]:
    """Point file descriptor 1 (where relaunch echoes tee'd lines) at ``path`` for a while."""
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(fd, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(fd)


def run_group(
    name: str,
    args: tuple[str, ...],
    nprocs: int,
    log_dir: str,
    redirects: Std = Std.NONE,
    tee: Std = Std.NONE,
) -> None:
    """``start_processes`` + ``wait`` + ``close`` of ``nprocs`` copies of ``python *args``."""
    ctx = start_processes(
        name,
        sys.executable,
        dict.fromkeys(range(nprocs), args),
        {rank: dict(MARK) for rank in range(nprocs)},
        log_dir,
        redirects=redirects,
        tee=tee,
    )
    try:
        result = ctx.wait()
    finally:
        ctx.close()
    if result is None or result.is_failed():
        raise RuntimeError(f"group {name!r} failed: {result}")


def popen_all(argvs: list[list[str]]) -> None:
    """Start every argv, then wait for all; whatever happens, none is left running."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv in argvs:
            procs.append(subprocess.Popen(argv))
    finally:
        codes = [proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"a floor process failed: exit codes {codes}")


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


percentile = harness.percentile


# -- 1. start-up overhead ---------------------------------------------------------------------


def startup_floor(nprocs: int) -> float:
    argv = [sys.executable, *NOOP_ARGS]
    started = time.perf_counter()
    popen_all([argv] * nprocs)
    return time.perf_counter() - started


def startup_relaunch(nprocs: int) -> float:
    with fresh_log_dir() as log_dir:
        started = time.perf_counter()
        run_group("noop", NOOP_ARGS, nprocs, log_dir)
        return time.perf_counter() - started


def bench_startup(reps: int, nprocs_list: Sequence[int] = STARTUP_NPROCS) -> list[Check]:
    log(f"[1/3] start-up overhead: N in {tuple(nprocs_list)}, {reps} repetitions, alternating")
    # Warm up: the page cache, and relaunch's once-per-process orphan guardian.
    startup_relaunch(2)
    startup_floor(2)
    rows: list[tuple[int, float, float]] = []
    for nprocs in nprocs_list:
        floor: list[float] = []
        ours: list[float] = []
        for rep in range(reps):
            # Alternate which side goes first, so neither always runs on a warmer machine.
            sides: list[tuple[Callable[[int], float], list[float]]] = [
                (startup_floor, floor),
                (startup_relaunch, ours),
            ]
            for measure, samples in sides if rep % 2 == 0 else reversed(sides):
                samples.append(measure(nprocs))
        rows.append((nprocs, median_ms(floor), median_ms(ours)))
    checks = []
    print("\n1. start-up: N no-op workers (python -S -c pass), start + wait + close, medians")
    print(
        f"{'N':>4} {'Popen floor ms':>15} {'relaunch ms':>12} {'extra ms/proc':>14}"
        f" {'ratio':>6}  budget <= 1.2"
    )
    for nprocs, floor_ms, ours_ms in rows:
        ratio = ours_ms / floor_ms
        ok = ratio <= STARTUP_BUDGET
        extra = (ours_ms - floor_ms) / nprocs
        print(
            f"{nprocs:>4} {floor_ms:>15.2f} {ours_ms:>12.2f} {extra:>14.2f}"
            f" {ratio:>6.3f}  {verdict(ok)}"
        )
        checks.append(
            Check(f"start-up ratio, N={nprocs}", f"{ratio:.3f}", f"<= {STARTUP_BUDGET}", ok)
        )
    return checks


# -- 2. tee throughput ------------------------------------------------------------------------


def count_log_lines(log_dir: str, nprocs: int, lines: int) -> list[int]:
    """Lines in each rank's stdout.log; -1 where the count is right but the text is not."""
    expected = b"".join(expected_line(i) for i in range(lines))
    counts = []
    for rank in range(nprocs):
        with open(os.path.join(log_dir, str(rank), "stdout.log"), "rb") as file:
            data = file.read()
        counts.append(data.count(b"\n"))
        if counts[-1] == lines and data != expected:
            counts[-1] = -1
    return counts


def read_syscalls() -> int:
    """read() calls made so far by this process, all threads (0 where /proc has no io file)."""
    try:
        with open("/proc/self/io") as file:
            for line in file:
                if line.startswith("syscr:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class TeeRun:
    wall: float  # s, start_processes + wait + close
    launcher_cpu: float  # s, this process, all threads
    workers_cpu: float  # s, the workers (reaped children)
    reads: int  # read() calls by this process
    lost: int  # lines missing or altered in the log files


def tee_run(tee: bool, nprocs: int, lines: int, env: dict[str, str], console: str) -> TeeRun:
    """One group printing ``lines`` lines per worker, stdout tee'd or redirected to a file."""
    kwargs: dict[str, Any] = {"tee": Std.OUT} if tee else {"redirects": Std.OUT}
    args = (PRINT_LINES, str(lines))
    with fresh_log_dir() as log_dir, stdout_to(console):
        reads = read_syscalls()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = time.process_time()
        started = time.perf_counter()
        ctx = start_processes(
            "w",
            sys.executable,
            dict.fromkeys(range(nprocs), args),
            {rank: {**env, **MARK} for rank in range(nprocs)},
            log_dir,
            **kwargs,
        )
        try:
            result = ctx.wait()
        finally:
            ctx.close()
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        reads = read_syscalls() - reads
        if result is None or result.is_failed():
            raise RuntimeError(f"tee workers failed: {result}")
        workers_cpu = sum(
            getattr(after, f) - getattr(children, f) for f in ("ru_utime", "ru_stime")
        )
        counts = count_log_lines(log_dir, nprocs, lines)
    lost = sum(lines - count if count >= 0 else lines for count in counts)
    return TeeRun(wall, cpu, workers_cpu, reads, lost)


def check_console(path: str, nprocs: int) -> tuple[int, int]:
    """(intact prefixed lines that reached the console, in order per rank; other lines)."""
    next_index = dict.fromkeys(range(nprocs), 0)
    prefixes = {f"[w{rank}]:".encode(): rank for rank in range(nprocs)}
    intact = bad = 0
    with open(path, "rb") as file:
        for line in file:
            head, sep, rest = line.partition(b":")
            rank = prefixes.get(head + sep)
            if rank is not None and rest == expected_line(next_index[rank]):
                next_index[rank] += 1
                intact += 1
            else:
                bad += 1
    return intact, bad


#: How the tee workers' stdout is buffered: Python's default for a pipe or a file (block
#: buffered), and PYTHONUNBUFFERED=1 (each print() is two write() calls), which jobs often set
#: to see their logs live. An empty PYTHONUNBUFFERED counts as unset.
TEE_VARIANTS = {
    "buffered (Python default)": {"PYTHONUNBUFFERED": ""},
    "unbuffered (PYTHONUNBUFFERED=1)": {"PYTHONUNBUFFERED": "1"},
}


def bench_tee(reps: int, nprocs: int, lines: int) -> list[Check]:
    total = nprocs * lines
    mb = total * len(expected_line(lines // 2)) / 1e6
    log(f"[2/3] tee throughput: {nprocs} workers x {lines} lines, {reps} repetitions, alternating")
    checks: list[Check] = []
    report = []
    for variant, env in TEE_VARIANTS.items():
        runs: dict[bool, list[TeeRun]] = {True: [], False: []}
        lost = 0
        for rep in range(reps + 1):  # the first repetition is a warm-up
            for tee in (True, False) if rep % 2 == 0 else (False, True):
                run = tee_run(tee, nprocs, lines, env, os.devnull)
                lost += run.lost
                if rep > 0:
                    runs[tee].append(run)
        # One more tee run with the console captured in a file, to check what reached it.
        with tempfile.NamedTemporaryFile(prefix="relaunch-bench-console-") as console:
            lost += tee_run(True, nprocs, lines, env, console.name).lost
            intact, bad = check_console(console.name, nprocs)

        def med(tee: bool, what: Callable[[TeeRun], float]) -> float:
            return statistics.median(what(run) for run in runs[tee])  # noqa: B023

        tee_ms, file_ms = med(True, lambda r: r.wall) * 1e3, med(False, lambda r: r.wall) * 1e3
        ratio = tee_ms / file_ms
        ok = ratio <= TEE_BUDGET
        report.append(
            f"{variant:<32} {file_ms:>9.1f} {tee_ms:>8.1f} {ratio:>6.3f} {verdict(ok):<4}"
            f" {med(False, lambda r: r.workers_cpu) * 1e3:>9.0f}"
            f" {med(True, lambda r: r.workers_cpu) * 1e3:>9.0f}"
            f" {med(True, lambda r: r.launcher_cpu) * 1e3:>9.0f}"
            f" {med(True, lambda r: r.reads):>9.0f}"
            f"\n{'':<32}   lines lost in log files over {2 * reps + 3} runs: {lost};"
            f" console (captured run): {intact}/{total} intact, {bad} bad"
        )
        checks += [
            Check(f"tee / redirect, {variant.split()[0]}", f"{ratio:.3f}", f"<= {TEE_BUDGET}", ok),
            Check(f"lines lost in logs, {variant.split()[0]}", str(lost), "0", lost == 0),
            Check(
                f"console lines intact, {variant.split()[0]}",
                f"{intact}/{total}, {bad} bad",
                f"{total}/{total}",
                intact == total and bad == 0,
            ),
        ]
    print(f"\n2. tee throughput: {nprocs} workers x {lines} print() lines (~{mb:.0f} MB), medians")
    print(
        f"{'worker stdout':<32} {'file ms':>9} {'tee ms':>8} {'ratio':>6} {'<=1.3':<4}"
        f" {'wCPU file':>9} {'wCPU tee':>9} {'lCPU tee':>9} {'reads tee':>9}"
    )
    for line in report:
        print(line)
    print(
        "   file = redirects=Std.OUT, tee = tee=Std.OUT; wCPU = workers' CPU ms, lCPU = launcher"
        " CPU ms\n   (all its threads), reads = the launcher's read() calls, per run"
    )
    return checks


# -- 3. line latency --------------------------------------------------------------------------


def read_latencies(argv: list[str], prefix: bytes) -> list[float]:
    """Start ``argv`` with stdout a pipe; latency in ms of each line, from its embedded stamp."""
    latencies: list[float] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        partial = b""
        while chunk := os.read(fd, 1 << 16):
            arrival = time.time_ns()
            *lines, partial = (partial + chunk).split(b"\n")
            for line in lines:
                if line.startswith(prefix):
                    stamp = int(line[len(prefix) :].split()[1])
                    latencies.append((arrival - stamp) / 1e6)
    finally:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # the launcher's guardian then kills its worker
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited with {proc.returncode}")
    return latencies


def summarize(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    return percentile(ordered, 0.5), percentile(ordered, 0.99), ordered[-1]


def bench_latency(count: int, gap: float) -> list[Check]:
    log(f"[3/3] line latency: {count} lines {gap * 1e3:g} ms apart, tee'd and direct")
    worker_args = ["-u", STAMPED_LINES, str(count), str(gap)]
    # Floor: the same worker writing straight into the pipe this process reads.
    floor = read_latencies([sys.executable, *worker_args], b"")
    with fresh_log_dir() as log_dir:
        argv = [sys.executable, TEE_LATENCY, log_dir, str(count), str(gap), MARK[harness.MARK_VAR]]
        tee = read_latencies(argv, b"[lat0]:")
    f50, f99, fmax = summarize(floor)
    p50, p99, pmax = summarize(tee)
    ok50, ok99 = p50 < LATENCY_P50_BUDGET_MS, p99 < LATENCY_P99_BUDGET_MS
    print(f"\n3. line latency (arrival on console - time.time_ns() in worker), {count} lines")
    print(f"{'':>30} {'lines':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    print(f"{'floor: worker -> pipe':>30} {len(floor):>6} {f50:>8.3f} {f99:>8.3f} {fmax:>8.3f}")
    print(f"{'relaunch tee -> console':>30} {len(tee):>6} {p50:>8.3f} {p99:>8.3f} {pmax:>8.3f}")
    print(f"   budget p50 < 2 ms {verdict(ok50)}, p99 < 20 ms {verdict(ok99)}")
    return [
        Check("latency p50", f"{p50:.3f} ms", f"< {LATENCY_P50_BUDGET_MS} ms", ok50),
        Check("latency p99", f"{p99:.3f} ms", f"< {LATENCY_P99_BUDGET_MS} ms", ok99),
        Check("latency lines received", f"{len(tee)}/{count}", f"{count}", len(tee) == count),
    ]


# -- main --------------------------------------------------------------------------------------


LAUNCHERS = False  # start_processes in this process, against a Popen floor
ORPHANS = False  # start_processes runs in this process: relaunch's guardian is our child

QUICK = {"reps": 2, "tee_reps": 1, "tee_lines": 20_000, "latency_lines": 200, "nprocs": [1, 8]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=11, help="start-up repetitions per side")
    parser.add_argument(
        "--nprocs",
        type=int,
        nargs="+",
        default=list(STARTUP_NPROCS),
        help="start-up: workers per run (default: %(default)s)",
    )
    parser.add_argument("--tee-reps", type=int, default=7, help="tee repetitions per side")
    parser.add_argument("--tee-lines", type=int, default=200_000, help="lines per tee worker")
    parser.add_argument("--tee-procs", type=int, default=2, help="tee workers")
    parser.add_argument("--latency-lines", type=int, default=1000)
    parser.add_argument("--latency-gap", type=float, default=0.002, help="seconds between lines")
    parser.add_argument(
        "--only", choices=("startup", "tee", "latency"), action="append", help="run only these"
    )


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    MARK[harness.MARK_VAR] = ctx.mark
    only = set(opts.only or ("startup", "tee", "latency"))
    checks: list[Check] = []
    if "startup" in only:
        checks += bench_startup(opts.reps, opts.nprocs)
    if "tee" in only:
        checks += bench_tee(opts.tee_reps, opts.tee_procs, opts.tee_lines)
    if "latency" in only:
        checks += bench_latency(opts.latency_lines, opts.latency_gap)
    return checks
