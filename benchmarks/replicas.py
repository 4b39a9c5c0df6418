"""Replica groups: torchft's groups with one worker SIGKILLed, the documented way vs relaunch.

Run by hand: ``python -m benchmarks replicas [--quick] [--reps N] [--groups 2 3]
[--sides documented relaunch preload] [--steps N] [--kill-step K] [--pace S]`` (issue 46).

**The job** (benchmarks/workers/torchft_train.py): torchft 0.2.0's data-parallel training on
CPU and gloo, ``--groups`` replica groups of 1 rank, a ``Manager`` with ``min_replica_size=1``,
``--pace`` s of "compute" a step, ``--steps`` steps. The worker of group 1 SIGKILLs itself after
its step ``--kill-step`` on its first attempt (it prints the moment first: the kill's time is
the worker's own ``time.time()``, as every step's is). Every group ends with a digest of its
weights.

**The sides**, alternating, a job each per repetition:

- ``documented``: torchft's documented way: ``torchft_lighthouse --min_replicas 1`` started by
  hand (its defaults: a 5 s heartbeat timeout; ``--heartbeat-timeout-ms`` changes it), then one
  ``torchrun --nproc-per-node 1 --max-restarts 2 --master-port P_g`` per group, each given
  ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE``;
- ``relaunch``: ``relaunch --replica-groups R --nproc-per-node 1 --max-restarts 2``, nothing
  else (relaunch serves each group's store, starts the lighthouse and sets the variables);
- ``preload``: the same with ``--preload torch,torch._dynamo,torchft`` (the failed group's
  worker restarts warm; ``torch._dynamo`` because torch's ``DistributedDataParallel``, which
  torchft's wraps, imports it as it is built: without it a warm restart was back in 1.27 s,
  1.16 s of it building that wrapper).

**The figures**, per failure (medians over ``--reps``, ``[min-max]``):

- *stall*: the healthy groups' longest gap between two consecutive steps, from the last step
  before the kill to the end of the run (the failed group's return, its heal included);
- *back*: from the kill to the failed group's next step (its launcher's restart, the new
  worker's start, its quorum and its heal from a live group);
- *restart*: from the kill to the failed group's new worker's first line;
- *lost*: the steps the failed group did not take part in (its first step after the kill
  minus the kill's step minus 1);
- *step*: the healthy groups' median step interval before the kill;
- *identical*: every group ended at the same step (``--steps`` or the first after it that
  every group took part in) with the same weights.

**Budgets** (the ``preload`` side, relaunch's warm restart; the ``relaunch`` side is shown
beside it, the documented way for comparison): stall <= 1.0 s and back <= 1.5 s (medians), and
every run of every relaunch side recovered with identical weights.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import IO

from benchmarks import harness
from benchmarks.harness import RELAUNCH, TORCHRUN, BenchError, Check, fmt, log, median
from benchmarks.recovery import spread
from relaunch.endpoints import find_free_port
from tests.support.ft_lines import Line, parse
from tests.support.procs import kill_pid, pid_alive

QUICK = {"reps": 1, "steps": 40, "kill_step": 20}
STALL_BUDGET_S = 1.0
BACK_BUDGET_S = 1.5
KILL_GROUP = 1
LIGHTHOUSE = "torchft_lighthouse"
BUDGETED = "preload"
RUN_TIMEOUT_S = 90.0  # a job's start and recovery, on top of its steps' pace
PORT_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0  # what the lighthouse gets after SIGTERM
FT_VARS = ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE")


@dataclass(frozen=True)
class Side:
    key: str
    launcher: str  # RELAUNCH or TORCHRUN
    what: str
    flags: tuple[str, ...] = ()


SIDES = {
    "documented": Side("documented", TORCHRUN, "lighthouse + a torchrun a group"),
    "relaunch": Side("relaunch", RELAUNCH, "relaunch --replica-groups R"),
    "preload": Side(
        "preload",
        RELAUNCH,
        "relaunch --replica-groups R --preload",
        ("--preload", "torch,torch._dynamo,torchft"),
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3, help="jobs per side and group count")
    parser.add_argument(
        "--groups", type=int, nargs="+", default=[2], help="replica groups (default: 2; also 3)"
    )
    parser.add_argument(
        "--sides", nargs="+", choices=list(SIDES), default=list(SIDES), help="(default: all)"
    )
    parser.add_argument("--steps", type=int, default=100, help="steps a job trains")
    parser.add_argument("--kill-step", type=int, default=50, help="group 1 dies after this step")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds of compute a step")
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        help="the documented way's lighthouse --heartbeat_timeout_ms (default: its own, 5000)",
    )


def read_lines(paths: list[str]) -> list[Line]:
    """The workers' lines in the launchers' stdout (``PATH.out`` for each of ``paths``)."""
    lines: list[Line] = []
    for path in paths:
        with open(path + ".out", errors="replace") as file:
            lines += parse(file.read())
    return lines


@dataclass
class Run:
    """One job's figures (see the module's docstring); None where it did not get there."""

    stall_s: float | None
    back_s: float | None
    restart_s: float | None
    lost: int | None
    step_s: float | None
    identical: bool
    digests: dict[int, str] = field(default_factory=dict)  # group -> its final digest


def figures(lines: list[Line], groups: int, steps: int) -> Run:
    """The figures of one job from its workers' lines."""
    kills = [line for line in lines if line.kind == "kill"]
    done = {line.group: line for line in lines if line.kind == "done"}
    digests = {group: line.fields["sha256"] for group, line in done.items()}
    identical = (
        len(done) == groups
        and len({line.step for line in done.values()}) == 1
        and all(line.step >= steps for line in done.values())
        and len(set(digests.values())) == 1
    )
    if not kills:
        return Run(None, None, None, None, None, identical, digests)
    kill = kills[0]
    failed = [line for line in lines if line.group == kill.group]
    after = [line for line in failed if line.kind == "step" and line.at > kill.at]
    restarts = [line for line in failed if line.kind == "start" and line.at > kill.at]
    gaps: list[float] = []
    before: list[float] = []
    for group in set(range(groups)) - {kill.group}:
        times = sorted(line.at for line in lines if line.group == group and line.kind == "step")
        for earlier, later in itertools.pairwise(times):
            (gaps if later > kill.at else before).append(later - earlier)
    return Run(
        stall_s=max(gaps) if gaps else None,
        back_s=after[0].at - kill.at if after else None,
        restart_s=restarts[0].at - kill.at if restarts else None,
        lost=after[0].step - kill.step - 1 if after else None,
        step_s=median(before) if before else None,
        identical=identical,
        digests=digests,
    )


def wait_port(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Until something listens on 127.0.0.1:``port`` (the lighthouse)."""
    while True:
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.settimeout(0.2)
            sock.connect(("127.0.0.1", port))
            return
        if proc.poll() is not None:
            raise BenchError(f"the lighthouse exited {proc.returncode}")
        if time.monotonic() > deadline:
            raise BenchError("the lighthouse did not listen")
        time.sleep(0.05)


class Job:
    """The processes of one job (launchers, the documented way's lighthouse), their logs."""

    def __init__(self, run_dir: str, env: dict[str, str]) -> None:
        self.dir, self.env = run_dir, env
        self.launchers: list[subprocess.Popen[bytes]] = []
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.logs: list[str] = []  # each process's output, as a path without .out/.err
        self._files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str], extra: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start ``argv``, its stdout (the workers' lines) to NAME.out, its stderr (torchft's
        logs, the launcher's) to NAME.err: apart, so that no log write cuts into a line."""
        path = os.path.join(self.dir, name)
        out = open(path + ".out", "wb")  # noqa: SIM115  closed by close()
        err = open(path + ".err", "wb")  # noqa: SIM115  closed by close()
        self._files += [out, err]
        self.logs.append(path)
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={**self.env, **extra}
        )

    def wait(self, deadline: float) -> None:
        """Until every launcher has exited; BenchError past ``deadline`` or when one failed."""
        for proc in self.launchers:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise BenchError(f"timed out: {self.tail()}") from None
            if proc.returncode != 0:
                raise BenchError(f"a launcher exited {proc.returncode}: {self.tail()}")

    def tail(self) -> str:
        """The last line of each process's stderr."""
        return "; ".join(harness.last_line(path + ".err") for path in self.logs)

    def close(self) -> None:
        """Stop the lighthouse, kill what is left of the launchers (by pid), close the logs."""
        procs = [*self.launchers, *([self.lighthouse] if self.lighthouse else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if pid_alive(proc.pid):
                kill_pid(proc.pid)
            proc.wait()
        for out in self._files:
            out.close()


def worker_args(opts: argparse.Namespace) -> list[str]:
    return [
        *("--steps", str(opts.steps), "--pace", str(opts.pace)),
        *("--kill-group", str(KILL_GROUP), "--kill-step", str(opts.kill_step)),
    ]


def one_job(
    ctx: harness.Context, launcher: harness.Launcher, side: Side, groups: int, rep: int
) -> Run:
    """Run the job once on ``side``: start it, wait for its end, read its figures."""
    opts = ctx.opts
    run_dir = os.path.join(ctx.tmp, f"{side.key}-{groups}-{rep}")
    os.makedirs(run_dir)
    env = {k: v for k, v in ctx.env.items() if k not in FT_VARS}
    job = Job(run_dir, env)
    script = harness.worker("torchft_train.py")
    deadline = time.monotonic() + RUN_TIMEOUT_S + opts.steps * (opts.pace + 0.2)
    try:
        if side.launcher == TORCHRUN:
            port = find_free_port()
            argv = [LIGHTHOUSE, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"]
            if opts.heartbeat_timeout_ms is not None:
                argv += ["--heartbeat_timeout_ms", str(opts.heartbeat_timeout_ms)]
            job.lighthouse = job.start("lighthouse", argv, {})
            wait_port(port, job.lighthouse, time.monotonic() + PORT_TIMEOUT_S)
            for group in range(groups):
                flags = ["--nproc-per-node", "1", "--max-restarts", "2"]
                flags += ["--master-port", str(find_free_port())]
                ft_env = {
                    "REPLICA_GROUP_ID": str(group),
                    "NUM_REPLICA_GROUPS": str(groups),
                    "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
                }
                argv = launcher.argv(flags, script, *worker_args(opts))
                job.launchers.append(job.start(f"group{group}", argv, ft_env))
        else:
            flags = ["--replica-groups", str(groups), "--nproc-per-node", "1"]
            flags += ["--max-restarts", "2", *side.flags]
            argv = launcher.argv(flags, script, *worker_args(opts))
            job.launchers.append(job.start("relaunch", argv, {}))
        job.wait(deadline)
    finally:
        job.close()
    run = figures(read_lines(job.logs), groups, opts.steps)
    if run.back_s is None:
        raise BenchError(f"the failed group never stepped again: {job.tail()}")
    return run


def collect(ctx: harness.Context) -> None:
    """What a job left behind, killed and noted (after every job)."""
    ctx.collect()


def unavailable(ctx: harness.Context, side: Side, launcher: harness.Launcher) -> str | None:
    """Why ``side`` cannot run here, or None."""
    if launcher.unavailable is not None:
        return launcher.unavailable
    probe = subprocess.run([sys.executable, "-c", "import torchft"], capture_output=True)
    if probe.returncode != 0:
        return "import torchft fails"
    if side.launcher == TORCHRUN and shutil.which(LIGHTHOUSE) is None:
        return f"no {LIGHTHOUSE} on PATH"
    return None


HEADER = (
    f"  {'side':<44} {'step':>5} {'stall':>17} {'back':>17} {'restart':>7} {'lost':>6}"
    f" {'identical':>9}"
)


def row(side: Side, runs: list[Run], error: str | None) -> str:
    if not runs:
        return f"  {side.what:<44} {error}"

    def mid(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        return fmt(median(known) if known else None, ".2f")

    def both(values: list[float | None]) -> str:
        return spread([v for v in values if v is not None])

    note = f"  ({error})" if error else ""
    return (
        f"  {side.what:<44} {mid([r.step_s for r in runs]):>5}"
        f" {both([r.stall_s for r in runs]):>17}"
        f" {both([r.back_s for r in runs]):>17} {mid([r.restart_s for r in runs]):>7}"
        f" {','.join(str(r.lost) for r in runs):>6}"
        f" {sum(r.identical for r in runs)} of {len(runs)}{note}"
    )


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    relaunch, torchrun = ctx.launchers(harness.Launcher)
    launchers = {RELAUNCH: relaunch, TORCHRUN: torchrun}
    sides = [SIDES[key] for key in opts.sides]
    why = {side.key: unavailable(ctx, side, launchers[side.launcher]) for side in sides}
    checks: list[Check] = []
    for groups in opts.groups:
        print(
            f"\n{groups} replica groups of 1 rank, {opts.steps} steps of {opts.pace} s compute;"
            f" group {KILL_GROUP}'s worker SIGKILLed after step {opts.kill_step}"
            f"\n(s; median [min-max] of {opts.reps}; stall: the healthy groups' longest gap"
            " between steps; back: kill -> the failed group's next step)"
        )
        print(HEADER)
        runnable = {s.key: s for s in sides if why[s.key] is None}
        errors: dict[str, str] = {}
        calls = {
            key: (lambda rep, s=side, n=groups: one_job(ctx, launchers[s.launcher], s, n, rep))
            for key, side in runnable.items()
        }
        samples = harness.run_alternating(
            calls, dict.fromkeys(calls, opts.reps), errors, lambda _side: collect(ctx)
        )
        results: dict[str, list[Run]] = {}
        for side in sides:
            runs: list[Run] = samples.get(side.key, [])
            results[side.key] = runs
            print(row(side, runs, why[side.key] or errors.get(side.key)))
        ctx.data[f"groups_{groups}"] = {
            key: [asdict(r) for r in runs] for key, runs in results.items()
        }
        checks += group_checks(groups, sides, results, opts.reps)
    return checks


def group_checks(
    groups: int, sides: list[Side], results: dict[str, list[Run]], reps: int
) -> list[Check]:
    """The budgets of ``BUDGETED`` (the documented way's medians beside them), and every
    relaunch side's runs recovered with identical weights."""

    def mid(key: str, name: str) -> float | None:
        values = [getattr(r, name) for r in results.get(key, []) if getattr(r, name) is not None]
        return median(values) if values else None

    checks: list[Check] = []
    for side in sides:
        if side.launcher != RELAUNCH:
            continue
        runs = results[side.key]
        good = sum(r.identical and r.back_s is not None for r in runs)
        checks.append(
            Check(
                f"{groups} groups, {side.key}: every run recovered, identical weights",
                f"{good} of {len(runs)}",
                f"{reps} of {reps}",
                len(runs) == reps and good == reps,
            )
        )
    if BUDGETED in results:
        for name, what, budget in (
            ("stall_s", "healthy groups' stall", STALL_BUDGET_S),
            ("back_s", "kill -> failed group's next step", BACK_BUDGET_S),
        ):
            value = mid(BUDGETED, name)
            beside = ", ".join(
                f"{key} {fmt(mid(key, name), '.2f')} s" for key in results if key != BUDGETED
            )
            checks.append(
                Check(
                    f"{groups} groups: {what}, {BUDGETED}" + (f" ({beside})" if beside else ""),
                    f"{fmt(value, '.2f')} s",
                    f"<= {budget:g} s",
                    None if value is None else value <= budget,
                )
            )
    if not checks:
        log(f"{groups} groups: no relaunch side measured")
    return checks
