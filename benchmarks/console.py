"""Console throughput with progress bars, relaunch vs torchrun, and the cost of the worker API.

Run by hand (not part of the test suite): ``python -m benchmarks console [--quick]``.

Four measurements:

1. ``console``: 8 ranks each redraw a tqdm-like bar with ``\\r`` on stderr 100 times a second
   for 5 s and print a log line on stdout every second, under ``relaunch --tee 3`` and
   ``torchrun --tee 3``, with the console a file (a CI log) and a pseudo-terminal. Wall time,
   the launcher's own CPU, what reached the console, and whether every log line, every final
   bar state and every byte of the log files arrived.
2. ``flood``: the same bars on a terminal, with 2 log lines per refresh per rank (1,600 lines/s):
   how much the live area's redraws add to what the terminal receives.
3. ``cost``: ns per ``relaunch.report_progress`` and ``relaunch.stop_requested`` call in a
   worker under relaunch (the shared-memory path) and outside it (the no-op path).
4. ``nodebar``: the launcher's CPU with 8 ranks calling ``report_progress`` every 1 ms (the
   agent draws a bar per node from it) against the same ranks not calling it.

Standard library only. Only relaunch is held to budgets; torchrun's numbers are there for
comparison. The exit status is 0 when every relaunch budget was measured and holds. See
benchmarks/README.md for what each measurement means.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks import harness
from benchmarks.harness import RELAUNCH, BenchError, Check, fmt, log, median

RANKS = 8
HZ = 100.0  # bar refreshes per second per rank
SECONDS = 5.0  # of bar refreshes
FLOOD_SECONDS = 3.0
FLOOD_LINES = 2  # log lines per bar refresh per rank in the flood
COST_CALLS = 1_000_000
COST_REPS = 3
COST_BUDGET_NS = 5000.0  # report_progress under relaunch, median ns per call
REDRAW_BUDGET_HZ = 10.0  # the live area's timed redraws per second, at most
THROTTLE_S = 1.0  # off a terminal, a bar is printed at most once per this, plus its final state
REPORT_PERIOD_S = 0.001  # of report_progress calls in the node-bar measurement
TERM_SIZE = (40, 120)  # rows, columns of the pseudo-terminal
RUN_TIMEOUT_S = 120.0

PIPE, PTY = "file", "terminal"


ANSI_RE = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
PREFIX_RE = re.compile(rb"\[default(\d+)\]:")
LOG_RE = re.compile(rb"\[default(\d+)\]:log rank (\d+) line (\d+)")
BAR_RE = re.compile(rb"rank (\d+): +(\d+)%\|[# ]*\| (\d+)/(\d+) \[")
FINAL_ELAPSED_RE = re.compile(rb"100%\|#{20}\| \d+/\d+ \[([0-9.]+)s")
FINAL_RE = re.compile(
    rb"\[default(\d+)\]:rank (\d+): 100%\|#{20}\| (\d+)/\3 \[[0-9.]+s, [0-9.]+it/s\]"
)
NODE_PREFIX = b"[default node 0]:"
CALL_RE = re.compile(rb"CALL rank (\d+) (\d+) ns")


# -- launchers and runs ------------------------------------------------------------------------


Launcher = harness.Launcher


@dataclass
class Bench(harness.Bench[Launcher]):
    probed: set[str] = field(default_factory=set)  # launchers that ran the no-op check


@dataclass
class Run:
    """One launcher run: times, CPU and everything its console received."""

    code: int
    wall: float  # s, start to exit
    own_cpu: float  # s, user + system of the launcher process itself (all its threads)
    children_cpu: float  # s, of the processes it reaped (the workers)
    wait4_cpu: float  # s, wait4's rusage: both of the above (a cross-check)
    out: bytes  # the launcher's stdout (file mode) or all the terminal got (terminal mode)
    err: bytes  # the launcher's stderr (file mode; empty in terminal mode)
    log_dir: str


def proc_times(pid: int) -> tuple[float, float]:
    """(utime + stime, cutime + cstime) of ``pid`` in s, from /proc/<pid>/stat.

    Read while ``pid`` is a zombie that has not been reaped: its own times then cover all of
    its threads for its whole life, and its children's times every worker it reaped.
    """
    with open(f"/proc/{pid}/stat") as file:
        stat = file.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    tick = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return (utime + stime) / tick, (cutime + cstime) / tick


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` (our child) has exited, without reaping it; False after ``timeout``."""
    pidfd = os.pidfd_open(pid)
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


class TerminalReader(threading.Thread):
    """Everything written to a pseudo-terminal, read from its master side until it closes."""

    def __init__(self, master: int) -> None:
        super().__init__(name="pty-reader", daemon=True)
        self.master = master
        self.chunks: list[bytes] = []

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 1 << 16)
            except OSError:  # EIO: every slave side is closed
                return
            if not chunk:
                return
            self.chunks.append(chunk)


def launch(bench: Bench, argv: list[str], mode: str, log_dir: str) -> Run:
    """Run ``argv`` with its stdout and stderr files (``PIPE``) or a pseudo-terminal (``PTY``);
    time it, and read its CPU times while it is a zombie."""
    env = dict(bench.env)
    reader = None
    if mode == PTY:
        master, slave = pty.openpty()
        rows, cols = TERM_SIZE
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env["TERM"] = "xterm-256color"
        for name in ("COLUMNS", "LINES", "NO_COLOR"):
            env.pop(name, None)
        out_fd = err_fd = slave
        reader = TerminalReader(master)
        reader.start()
    else:
        out_fd = os.open(os.path.join(bench.tmp, "out.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err_fd = os.open(os.path.join(bench.tmp, "err.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd, env=env, cwd=bench.tmp
        )
    except BaseException:
        if reader is not None:
            os.close(out_fd)  # the reader sees EIO and stops
            reader.join(10.0)
            os.close(reader.master)
            out_fd = err_fd = -1
        raise
    finally:
        for fd in {out_fd, err_fd} - {-1}:
            os.close(fd)
    try:
        exited = wait_exit(proc.pid, RUN_TIMEOUT_S)
        wall = time.perf_counter() - started
        if not exited:
            harness.kill_pid(proc.pid)
        own, children = proc_times(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    except BaseException:
        harness.kill_pid(proc.pid)
        proc.wait()
        raise
    finally:
        if reader is not None:
            reader.join(10.0)  # the master reads EIO once the last writer (the guardian) is gone
            os.close(reader.master)
    if not exited:
        raise BenchError(f"{argv[0]} did not exit within {RUN_TIMEOUT_S:.0f} s; killed")
    if reader is not None:
        out, err = b"".join(reader.chunks), b""
    else:
        with open(os.path.join(bench.tmp, "out.txt"), "rb") as file:
            out = file.read()
        with open(os.path.join(bench.tmp, "err.txt"), "rb") as file:
            err = file.read()
    return Run(
        proc.returncode, wall, own, children, usage.ru_utime + usage.ru_stime, out, err, log_dir
    )


def fresh_log_dir(bench: Bench) -> str:
    path = os.path.join(bench.tmp, "logs", str(time.monotonic_ns()))
    os.makedirs(path)
    return path


def tail(run: Run) -> str:
    text = ANSI_RE.sub(b"", run.err or run.out).decode(errors="replace")
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


# -- a terminal, emulated ----------------------------------------------------------------------


TOKEN_RE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|(\r)|(\n)|([^\x1b\r\n]+)|\x1b")


def terminal_transcript(data: bytes, rows: int, cols: int) -> list[str]:
    """What a terminal ``rows`` x ``cols`` shows after ``data``, scrollback included: text,
    carriage return, line feed, autowrap, and the sequences relaunch draws its live area with
    (cursor up ``ESC[nA``, erase line ``ESC[2K`` / ``ESC[K``); colours are ignored."""
    lines: list[list[str]] = [[]]
    row = col = 0
    for match in TOKEN_RE.finditer(data.decode("utf-8", errors="replace")):
        params, final, cr, lf, text = match.groups()
        if text:
            while text:
                if col >= cols:  # autowrap
                    row, col = row + 1, 0
                    if row == len(lines):
                        lines.append([])
                line = lines[row]
                piece, text = text[: cols - col], text[cols - col :]
                if len(line) < col:
                    line.extend(" " * (col - len(line)))
                line[col : col + len(piece)] = piece
                col += len(piece)
        elif cr:
            col = 0
        elif lf:
            row += 1
            if row == len(lines):
                lines.append([])
        elif final == "A":
            top = max(0, len(lines) - rows)
            row = max(top, row - int(params or 1))
        elif final == "K":
            if params in ("", "0"):
                del lines[row][col:]
            elif params == "2":
                lines[row] = []
            elif params == "1":
                lines[row][: col + 1] = " " * min(col + 1, len(lines[row]))
    return ["".join(line).rstrip() for line in lines]


# -- 1. console throughput, 2. flood -----------------------------------------------------------


@dataclass
class Console:
    """What reached the console in one run, checked."""

    run: Run
    lines: int  # newlines the console got (file: stdout + stderr; terminal: all bytes)
    bytes: int
    bar_lines: int  # lines left showing a bar (file: printed; terminal: in the transcript)
    stale_bars: int  # of those, not a final state
    max_bar_lines: int  # most bar lines of one rank
    glued: int  # lines holding more than one rank prefix (one rank's output cut into another's)
    empty: int  # lines holding only a rank prefix
    logs_ok: int  # log lines intact, each exactly once
    logs_bad: int  # lines that are a log line cut, glued to other text, or not expected
    finals_ok: int  # ranks whose final bar state arrived intact, exactly once
    redraws: int  # terminal: erase sequences (each a redraw of the live area)
    timed_redraws: int  # terminal: redraws of the same bars, with no log line in them
    bar_seconds: float  # how long the slowest rank's bar ran (from its final state)
    files_ok: int  # ranks whose log files hold every byte the worker wrote


def final_bar(rank: int, total: int) -> bytes:
    return b"rank %d: 100%%|%s| %d/%d [" % (rank, b"#" * 20, total, total)


def log_lines(rank: int, n_logs: int) -> bytes:
    return b"".join(b"log rank %d line %d\n" % (rank, k) for k in range(1, n_logs + 1))


def check_log_files(log_dir: str, total: int, n_logs: int) -> int:
    """Ranks whose stderr.log has every refresh, in order, and the final newline, and whose
    stdout.log has every log line (wherever the launcher put the files under ``log_dir``)."""
    found: dict[tuple[int, str], str] = {}
    for root, _dirs, files in os.walk(log_dir):
        for name in files:
            if name in ("stdout.log", "stderr.log") and os.path.basename(root).isdigit():
                found[(int(os.path.basename(root)), name)] = os.path.join(root, name)
    complete = 0
    for rank in range(RANKS):
        try:
            with open(found[(rank, "stderr.log")], "rb") as file:
                err = file.read()
            with open(found[(rank, "stdout.log")], "rb") as file:
                out = file.read()
        except (KeyError, OSError):
            continue
        refreshes = err.split(b"\r")[1:]
        steps = [int(m.group(3)) if (m := BAR_RE.match(r)) else 0 for r in refreshes]
        complete += (
            steps == list(range(1, total + 1))
            and refreshes[-1].startswith(final_bar(rank, total))
            and err.endswith(b"\n")
            and out == log_lines(rank, n_logs)
        )
    return complete


def analyse(run: Run, mode: str, total: int, n_logs: int) -> Console:
    """Check what the console got: on a terminal, the transcript an emulated terminal is left
    with; in a file, the lines of stdout and stderr."""
    if mode == PTY:
        rows, cols = TERM_SIZE
        shown = [line.encode() for line in terminal_transcript(run.out, rows, cols)]
        raw = run.out
        segments = [ANSI_RE.sub(b"", s) for s in raw.split(b"\r\x1b[2K")]
        redraws = len(segments) - 1
        # A timed redraw: the same bars redrawn, no log line written, no bar added or ended.
        timed, previous = 0, -1
        for segment in segments:
            bars = len(BAR_RE.findall(segment))
            if b"log rank" not in segment and b"100%|" not in segment and bars == previous:
                timed += 1
            previous = bars
        elapsed = [float(m.group(1)) for m in FINAL_ELAPSED_RE.finditer(ANSI_RE.sub(b"", raw))]
        bar_seconds = max(elapsed, default=0.0)
    else:
        shown = ANSI_RE.sub(b"", run.out).split(b"\n") + ANSI_RE.sub(b"", run.err).split(b"\n")
        raw = run.out + run.err
        redraws = timed = 0
        bar_seconds = 0.0
    bar_lines = stale = glued = empty = logs_altered = 0
    per_rank = [0] * RANKS
    finals = [0] * RANKS
    logs: dict[tuple[int, int], int] = {}
    for line in shown:
        line = line.rstrip()
        prefixes = PREFIX_RE.findall(line)
        glued += len(prefixes) > 1
        empty += PREFIX_RE.fullmatch(line) is not None
        log_match = LOG_RE.fullmatch(line)
        if log_match and log_match.group(1) == log_match.group(2):
            key = (int(log_match.group(2)), int(log_match.group(3)))
            logs[key] = logs.get(key, 0) + 1
        elif b"log rank" in line:
            logs_altered += 1
        final = FINAL_RE.fullmatch(line)
        if final and final.group(1) == final.group(2) and int(final.group(1)) < RANKS:
            finals[int(final.group(1))] += 1
        for bar in BAR_RE.finditer(line):
            bar_lines += 1
            if int(bar.group(1)) < RANKS:
                per_rank[int(bar.group(1))] += 1
            stale += not (bar.group(3) == bar.group(4) == b"%d" % total)
    expected = {(rank, k) for rank in range(RANKS) for k in range(1, n_logs + 1)}
    logs_ok = sum(1 for key in expected if logs.get(key) == 1)
    unexpected = sum(count for key, count in logs.items() if key not in expected)
    return Console(
        run=run,
        lines=raw.count(b"\n"),
        bytes=len(raw),
        bar_lines=bar_lines,
        stale_bars=stale,
        max_bar_lines=max(per_rank),
        glued=glued,
        empty=empty,
        logs_ok=logs_ok,
        logs_bad=logs_altered + unexpected,
        finals_ok=sum(1 for count in finals if count == 1),
        redraws=redraws,
        timed_redraws=timed,
        bar_seconds=bar_seconds,
        files_ok=check_log_files(run.log_dir, total, n_logs),
    )


def bars_run(
    bench: Bench, launcher: Launcher, mode: str, total: int, hz: float, per_refresh: int
) -> Console:
    log_dir = fresh_log_dir(bench)
    flags = ("--standalone", "--nproc-per-node", str(RANKS), "--tee", "3", "--log-dir", log_dir)
    argv = launcher.argv(flags, bench.script("bars.py"), str(total), repr(hz), str(per_refresh))
    run = launch(bench, argv, mode, log_dir)
    if run.code != 0:
        raise BenchError(f"exit {run.code}: {tail(run)}")
    n_logs = total * per_refresh if per_refresh else total // max(1, round(hz))
    return analyse(run, mode, total, n_logs)


def usable(bench: Bench, launcher: Launcher) -> str | None:
    """None when ``launcher --tee 3`` runs a no-op worker (it also warms the bytecode cache)."""
    if launcher.unavailable is not None:
        return launcher.unavailable
    if launcher.name in bench.probed:
        return None
    log_dir = fresh_log_dir(bench)
    flags = ("--standalone", "--nproc-per-node", "2", "--tee", "3", "--log-dir", log_dir)
    try:
        run = launch(bench, launcher.argv(flags, bench.script("noop.py")), PIPE, log_dir)
    except (OSError, BenchError) as exc:
        launcher.unavailable = str(exc)
    else:
        if run.code != 0:
            launcher.unavailable = f"exit {run.code}: {tail(run)}"
    bench.collect()
    if launcher.unavailable is not None:
        log(f"  {launcher.name} cannot run: {launcher.unavailable}")
    bench.probed.add(launcher.name)
    return launcher.unavailable


def run_sides(
    bench: Bench, sides: dict[str, Callable[..., Any]], reps: int
) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """``reps`` runs of every side, alternating (see harness.run_alternating)."""
    errors: dict[str, str] = {}
    samples = harness.run_alternating(sides, dict.fromkeys(sides, reps), errors, bench.collect)
    return samples, errors


def bench_console(bench: Bench, reps: int, seconds: float, hz: float) -> list[Check]:
    total = round(seconds * hz)
    log(
        f"[1/4] console: {RANKS} ranks x {total} bar refreshes at {hz:g}/s + a log line a second,"
        f" --tee 3, console a file and a terminal, {reps} repetitions"
    )
    sides = {
        (mode, launcher.name): launcher
        for mode in (PIPE, PTY)
        for launcher in bench.launchers()
        if usable(bench, launcher) is None
    }
    samples, errors = run_sides(
        bench,
        {
            f"{mode}:{name}": (
                lambda rep, ln=launcher, m=mode: bars_run(bench, ln, m, total, hz, 0)
            )
            for (mode, name), launcher in sides.items()
        },
        reps,
    )
    n_logs = RANKS * (total // max(1, round(hz)))
    print(
        f"\n1. console: {RANKS} ranks x {total} refreshes of a \\r bar on stderr ({hz:g}/s, "
        f"{total / hz:g} s) + 1 stdout line/s, --tee 3; medians of {reps}, checks: worst run"
    )
    print(
        f"{'console':<9} {'launcher':<9} {'wall s':>6} {'lCPU s':>6} {'wCPU s':>6} {'lines':>5}"
        f" {'KiB':>6} {'bars':>5} {'stale':>5} {'max/rk':>6} {'glued':>5} {'empty':>5}"
        f" {'redraw':>6} {'timed/s':>7} {'logs ok':>10} {'finals':>6} {'files':>5}"
    )
    checks: list[Check] = []
    for (mode, name), _launcher in sides.items():
        runs: list[Console] = samples[f"{mode}:{name}"]
        if not runs:
            print(f"{mode:<9} {name:<9} not measured: {errors.get(f'{mode}:{name}', '?')}")
            continue

        def med(what: Callable[[Console], float], runs: list[Console] = runs) -> float:
            return median([what(c) for c in runs])

        logs_ok = min(c.logs_ok for c in runs)
        logs_bad = max(c.logs_bad for c in runs)
        finals = min(c.finals_ok for c in runs)
        files = min(c.files_ok for c in runs)
        timed_hz = max(c.timed_redraws / c.bar_seconds if c.bar_seconds else 0 for c in runs)
        most = max(c.max_bar_lines for c in runs)
        stale = max(c.stale_bars for c in runs)
        print(
            f"{mode:<9} {name:<9} {med(lambda c: c.run.wall):>6.2f}"
            f" {med(lambda c: c.run.own_cpu):>6.2f} {med(lambda c: c.run.children_cpu):>6.2f}"
            f" {med(lambda c: c.lines):>5.0f} {med(lambda c: c.bytes) / 1024:>6.1f}"
            f" {med(lambda c: c.bar_lines):>5.0f} {med(lambda c: c.stale_bars):>5.0f}"
            f" {most:>6} {med(lambda c: c.glued):>5.0f} {med(lambda c: c.empty):>5.0f}"
            f" {fmt(med(lambda c: c.redraws) if mode == PTY else None, '.0f'):>6}"
            f" {fmt(timed_hz if mode == PTY else None, '.1f'):>7}"
            f" {f'{logs_ok}/{n_logs}' + (f'+{logs_bad}' if logs_bad else ''):>10}"
            f" {f'{finals}/{RANKS}':>6} {f'{files}/{RANKS}':>5}"
        )
        if name != RELAUNCH:
            continue
        checks += [
            Check(
                f"console ({mode}): log lines intact, once",
                f"{logs_ok}/{n_logs}, {logs_bad} bad",
                f"{n_logs}/{n_logs}, 0 bad",
                logs_ok == n_logs and logs_bad == 0,
            ),
            Check(
                f"console ({mode}): final bars intact, once",
                f"{finals}/{RANKS}",
                f"{RANKS}/{RANKS}",
                finals == RANKS,
            ),
            Check(
                f"console ({mode}): log files complete",
                f"{files}/{RANKS}",
                f"{RANKS}/{RANKS}",
                files == RANKS,
            ),
        ]
        if mode == PIPE:
            # At most one line a THROTTLE_S per rank (the first at once), plus the final one.
            limit = math.ceil(total / hz / THROTTLE_S) + 2
            checks.append(
                Check(
                    f"console ({mode}): bar lines per rank", str(most), f"<= {limit}", most <= limit
                )
            )
        else:
            checks += [
                Check(f"console ({mode}): stale bar rows left", str(stale), "0", stale == 0),
                Check(
                    f"console ({mode}): timed redraws per s",
                    f"{timed_hz:.1f}",
                    f"<= {REDRAW_BUDGET_HZ:g}",
                    timed_hz <= REDRAW_BUDGET_HZ,
                ),
            ]
    legend = (
        f"wall = start to exit (ideal: {total / hz:g} s of bars + start-up); lCPU = user+system s"
        " of the launcher process itself, wCPU = of the workers it reaped (both from"
        " /proc/<pid>/stat of the exited, unreaped launcher); lines, KiB = what the console got"
        " (file: stdout+stderr; terminal: every byte); bars = lines showing a bar (terminal: rows"
        " left in the emulated transcript), stale = of them not a final state, max/rk = most bar"
        " lines of one rank, glued = lines holding two rank prefixes, empty = lines holding only"
        " a prefix; redraw = live-area erases, timed/s = those redrawing the same bars with no"
        " log line, per s of bars; logs ok = log lines intact and exactly once (+N: lines"
        " holding a cut or glued one), finals = final bar states intact and once, files = ranks"
        " whose log files hold every byte"
    )
    print(textwrap.fill(legend, 100, initial_indent="   ", subsequent_indent="   "))
    runs_all = [c.run for side in samples.values() for c in side]
    if runs_all:
        gap = max(abs(r.wait4_cpu - r.own_cpu - r.children_cpu) for r in runs_all)
        print(f"   cross-check: lCPU + wCPU differ from wait4's rusage by {gap:.3f} s at most")
    return checks


def bench_flood(bench: Bench, reps: int, seconds: float, hz: float, per: int) -> list[Check]:
    total = round(seconds * hz)
    log(
        f"[2/4] flood: {RANKS} ranks x {total} bar refreshes at {hz:g}/s, {per} log lines per"
        f" refresh, --tee 3, on a terminal, {reps} repetition(s)"
    )
    launchers = [ln for ln in bench.launchers() if usable(bench, ln) is None]
    samples, errors = run_sides(
        bench,
        {
            ln.name: (lambda rep, ln=ln: bars_run(bench, ln, PTY, total, hz, per))
            for ln in launchers
        },
        reps,
    )
    n_logs = RANKS * total * per
    log_kib = sum(len(log_lines(rank, total * per)) for rank in range(RANKS)) / 1024
    print(
        f"\n2. flood on a terminal: {RANKS} ranks x {total} bar refreshes ({hz:g}/s) + {per} stdout"
        f" lines per refresh\n   ({n_logs:,} lines, {log_kib:.0f} KiB of log text), --tee 3;"
        f" medians of {reps}, checks: worst run"
    )
    print(
        f"{'launcher':<9} {'wall s':>6} {'lCPU s':>6} {'term KiB':>8} {'x log':>5} {'redraw':>6}"
        f" {'redraw/s':>8} {'stale':>5} {'glued':>5} {'logs ok':>17} {'finals':>6}"
    )
    checks: list[Check] = []
    for launcher in launchers:
        runs: list[Console] = samples[launcher.name]
        if not runs:
            print(f"{launcher.name:<9} not measured: {errors.get(launcher.name, '?')}")
            continue
        kib = median([c.bytes for c in runs]) / 1024
        redraws = median([c.redraws for c in runs])
        per_s = median([c.redraws / c.bar_seconds if c.bar_seconds else 0 for c in runs])
        logs_ok = min(c.logs_ok for c in runs)
        logs_bad = max(c.logs_bad for c in runs)
        finals = min(c.finals_ok for c in runs)
        stale = max(c.stale_bars for c in runs)
        print(
            f"{launcher.name:<9} {median([c.run.wall for c in runs]):>6.2f}"
            f" {median([c.run.own_cpu for c in runs]):>6.2f} {kib:>8.0f} {kib / log_kib:>5.1f}"
            f" {redraws:>6.0f} {per_s:>8.0f} {stale:>5}"
            f" {median([c.glued for c in runs]):>5.0f}"
            f" {f'{logs_ok:,}/{n_logs:,}' + (f'+{logs_bad}' if logs_bad else ''):>17}"
            f" {f'{finals}/{RANKS}':>6}"
        )
        if launcher.name == RELAUNCH:
            checks += [
                Check(
                    "flood (terminal): log lines intact, once",
                    f"{logs_ok}/{n_logs}, {logs_bad} bad",
                    f"{n_logs}/{n_logs}, 0 bad",
                    logs_ok == n_logs and logs_bad == 0,
                ),
                Check("flood (terminal): stale bar rows left", str(stale), "0", stale == 0),
            ]
    print(
        "   term KiB = bytes the terminal got, x log = that over the log text alone; redraw ="
        " live-area\n   erases (each followed by a redraw of every bar), redraw/s = per s of bars"
    )
    return checks


# -- 3. the cost of report_progress and stop_requested -----------------------------------------


def cost_run(bench: Bench, under_relaunch: bool, calls: int, reps: int) -> dict[str, Any]:
    args = [bench.script("cost.py"), str(calls), str(reps)]
    env = dict(bench.env)
    if under_relaunch:
        argv = bench.relaunch.argv(("--standalone", "--nproc-per-node", "1"), *args)
    else:
        argv = [sys.executable, "-u", *args]
        for name in ("RELAUNCH_CHANNEL", "LOCAL_RANK"):
            env.pop(name, None)
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=env,
        cwd=bench.tmp,
        timeout=RUN_TIMEOUT_S,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(b"RESULT "):
            result: dict[str, Any] = json.loads(line[len(b"RESULT ") :])
            result["node_bar"] = NODE_PREFIX in proc.stderr + proc.stdout
            return result
    raise BenchError(
        f"exit {proc.returncode}, no result: {proc.stderr.decode(errors='replace')[-300:]}"
    )


def bench_cost(bench: Bench, calls: int, reps: int) -> list[Check]:
    log(f"[3/4] cost: {reps} x {calls} calls of each, under relaunch and outside it")
    results: dict[str, dict[str, Any]] = {}
    for name, under in (("under relaunch", True), ("outside relaunch", False)):
        try:
            results[name] = cost_run(bench, under, calls, reps)
        except (BenchError, subprocess.TimeoutExpired) as exc:
            log(f"  {name}: {exc}")
        bench.collect()
    print(f"\n3. cost per call, ns: median [min-max] of {reps} x {calls:,} calls in one worker")
    names = next(iter(results.values()))["results"] if results else {}
    print(f"{'call':<36}" + "".join(f" {side:>24}" for side in results))
    for call in names:
        cells = []
        for result in results.values():
            samples = result["results"][call]
            cells.append(f"{median(samples):.0f} [{min(samples):.0f}-{max(samples):.0f}]")
        print(f"{call:<36}" + "".join(f" {cell:>24}" for cell in cells))
    for side, result in results.items():
        print(
            f"   {side}: RELAUNCH_CHANNEL {'set' if result['channel'] else 'unset'}, channel"
            f" mapped: {'yes' if result['mapped'] else 'no'}, node bar on the console:"
            f" {'yes' if result['node_bar'] else 'no'}"
        )
    print("   python call floor = the same loop calling an empty Python function with (i, n)")
    got = results.get("under relaunch")
    if got is None:
        return [Check("report_progress under relaunch", "-", f"< {COST_BUDGET_NS:.0f} ns", None)]
    # The fastest sample: the call's own cost; a busy machine only ever adds to it.
    ns = min(got["results"]["report_progress(step, total)"])
    mapped = bool(got["mapped"])
    return [
        Check(
            "report_progress under relaunch (min)",
            f"{ns:.0f} ns",
            f"< {COST_BUDGET_NS:.0f} ns",
            ns < COST_BUDGET_NS and mapped,
        ),
        Check("  ... on the shared-memory path", "yes" if mapped else "no", "yes", mapped),
    ]


# -- 4. the agent's per-node bar ---------------------------------------------------------------


@dataclass
class NodeBarRun:
    run: Run
    bar_prints: int  # the node bar's prefix on the console: printed lines, or terminal draws
    call_ns: list[int]  # each rank's mean ns per call, timed in its loop
    rows_left: int  # terminal: transcript rows that show the node bar (1: its final state)
    glued: int  # terminal: worker lines that share a row with a node-bar row


def nodebar_run(bench: Bench, mode: str, report: bool, seconds: float) -> NodeBarRun:
    log_dir = fresh_log_dir(bench)
    flags = ("--standalone", "--nproc-per-node", str(RANKS), "--log-dir", log_dir)
    argv = bench.relaunch.argv(
        flags,
        bench.script("reporter.py"),
        str(round(seconds / REPORT_PERIOD_S)),
        repr(REPORT_PERIOD_S),
        "report" if report else "quiet",
    )
    run = launch(bench, argv, mode, log_dir)
    if run.code != 0:
        raise BenchError(f"exit {run.code}: {tail(run)}")
    raw = ANSI_RE.sub(b"", run.out + run.err)
    calls = [int(m.group(2)) for m in CALL_RE.finditer(raw)]
    rows_left = glued = 0
    if mode == PTY:
        for line in terminal_transcript(run.out, *TERM_SIZE):
            rows_left += NODE_PREFIX.decode() in line
            glued += NODE_PREFIX.decode() in line and "CALL rank" in line
    return NodeBarRun(run, raw.count(NODE_PREFIX), calls, rows_left, glued)


def bench_nodebar(bench: Bench, reps: int, seconds: float) -> list[Check]:
    log(
        f"[4/4] node bar: {RANKS} ranks, report_progress every 1 ms for {seconds:g} s or not,"
        f" relaunch without --tee, {reps} repetitions"
    )
    if usable(bench, bench.relaunch) is not None:
        return [Check("node bar: runs", "-", "-", None)]
    sides = {(mode, report): f"{mode}:{report}" for mode in (PIPE, PTY) for report in (0, 1)}
    samples, errors = run_sides(
        bench,
        {
            side: (lambda rep, m=mode, r=report: nodebar_run(bench, m, bool(r), seconds))
            for (mode, report), side in sides.items()
        },
        reps,
    )
    print(
        f"\n4. node bar: {RANKS} ranks calling report_progress every {REPORT_PERIOD_S * 1e3:g} ms"
        f" for {seconds:g} s, or an empty function; no --tee; medians of {reps}"
    )
    print(
        f"{'console':<9} {'workers':<15} {'wall s':>6} {'lCPU s':>6} {'wCPU s':>6}"
        f" {'call ns':>7} {'node bar':>8} {'rows left':>9} {'glued':>5}"
    )
    cpu: dict[tuple[str, int], float] = {}
    checks: list[Check] = []
    for (mode, report), side in sides.items():
        runs: list[NodeBarRun] = samples[side]
        what = "report_progress" if report else "empty function"
        if not runs:
            print(f"{mode:<9} {what:<15} not measured: {errors.get(side, '?')}")
            continue
        cpu[(mode, report)] = median([r.run.own_cpu for r in runs])
        call_ns = median([median(r.call_ns) for r in runs if r.call_ns])
        rows_left = max(r.rows_left for r in runs)
        glued = max(r.glued for r in runs)
        print(
            f"{mode:<9} {what:<15} {median([r.run.wall for r in runs]):>6.2f}"
            f" {cpu[(mode, report)]:>6.2f} {median([r.run.children_cpu for r in runs]):>6.2f}"
            f" {call_ns:>7.0f} {median([r.bar_prints for r in runs]):>8.0f}"
            f" {fmt(rows_left if mode == PTY else None, '.0f'):>9}"
            f" {fmt(glued if mode == PTY else None, '.0f'):>5}"
        )
        if mode == PTY and report:
            checks.append(
                Check(
                    "node bar (terminal, no --tee): worker lines glued to it",
                    str(glued),
                    "0",
                    glued == 0,
                )
            )
    for mode in (PIPE, PTY):
        if (mode, 1) in cpu and (mode, 0) in cpu:
            extra = cpu[(mode, 1)] - cpu[(mode, 0)]
            print(f"   {mode}: the node bar costs the launcher {extra * 1e3:+.0f} ms of CPU")
    print(
        "   call ns = each rank's mean time per call in its loop (right after a 1 ms sleep),"
        " median over ranks;\n   node bar = the bar's prefix on the console (file: printed"
        " lines; terminal: draws); rows left =\n   terminal transcript rows showing the node bar"
        " (1: its final state); glued = of them, rows that\n   also hold a worker's line (each"
        " worker prints one line at its end, straight to the terminal)"
    )
    return checks


# -- main --------------------------------------------------------------------------------------


QUICK = {
    "reps": 1,
    "seconds": 2.0,
    "flood_seconds": 1.0,
    "calls": 100_000,
    "nodebar_reps": 1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="console repetitions per side")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="seconds of bars")
    parser.add_argument("--hz", type=float, default=HZ, help="bar refreshes per second")
    parser.add_argument("--flood-reps", type=int, default=1, help="flood repetitions per side")
    parser.add_argument("--flood-seconds", type=float, default=FLOOD_SECONDS)
    parser.add_argument(
        "--flood-lines", type=int, default=FLOOD_LINES, help="log lines per refresh in the flood"
    )
    parser.add_argument("--calls", type=int, default=COST_CALLS, help="calls per cost sample")
    parser.add_argument("--cost-reps", type=int, default=COST_REPS, help="cost samples")
    parser.add_argument("--nodebar-reps", type=int, default=2, help="node-bar repetitions")
    parser.add_argument(
        "--only",
        action="append",
        choices=("console", "flood", "cost", "nodebar"),
        help="run only these measurements (repeatable)",
    )


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    only = set(opts.only or ("console", "flood", "cost", "nodebar"))
    relaunch, torchrun = ctx.launchers(Launcher)
    bench = ctx.bench(Bench, relaunch, torchrun)
    checks: list[Check] = []
    if "console" in only:
        checks += bench_console(bench, opts.reps, opts.seconds, opts.hz)
    if "flood" in only:
        checks += bench_flood(bench, opts.flood_reps, opts.flood_seconds, opts.hz, opts.flood_lines)
    if "cost" in only:
        checks += bench_cost(bench, opts.calls, opts.cost_reps)
    if "nodebar" in only:
        checks += bench_nodebar(bench, opts.nodebar_reps, opts.seconds)
    return checks
