"""The one harness of the benchmarks: the command line (``python -m benchmarks NAME``), the run
(temporary directory, environment, launchers, header, leak check, summary, JSON results), and
what the benchmarks share (checks, alternating repetitions, launcher commands).

A benchmark is a module of this package with a docstring (its first line is its description)
and these names:

- ``run(ctx: Context) -> list[Check]``: measure, print its tables, return its checks;
- ``add_arguments(parser)`` (optional): its own options;
- ``QUICK`` (optional): option defaults for ``--quick``, a short run for a smoke test;
- ``LAUNCHERS`` (optional, default True): it runs relaunch and torchrun side by side;
- ``ORPHANS`` (optional, default True): every child of ours left after a run is a leftover
  (the benchmark is a child subreaper); False where only marked processes count.

Leftovers: everything a run starts carries ``RELAUNCH_TEST_MARK=<mark>`` (``ctx.env``); after
each run (``Bench.collect``) and at the end, marked processes and adopted orphans still alive
after 3 s are killed by pid and reported, and fail the run.

Processes (liveness, killing by pid, the leak detector) come from tests/support/procs.py,
shared with the test suite. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, Generic, TypeVar

from tests.support.procs import (
    MARK_VAR,
    become_subreaper,
    cmdline,
    collect_leaks,
    kill_pid,
    our_children,
    pid_alive,
    proc_stat,
)

__all__ = ["MARK_VAR", "cmdline", "kill_pid", "our_children", "proc_stat"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "benchmarks", "workers")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ORPHAN_GRACE_S = 3.0  # what a launcher's leftovers get to exit after it did

RELAUNCH = "relaunch"
TORCHRUN = "torchrun"


class BenchError(Exception):
    """One run of one side went wrong; that side is dropped from the measurement."""


# -- checks and numbers ------------------------------------------------------------------------


def log(message: str) -> None:
    """Progress goes to stderr: stdout holds the results (and is redirected at times)."""
    print(message, file=sys.stderr, flush=True)


def verdict(ok: bool | None) -> str:
    return "SKIP" if ok is None else ("PASS" if ok else "FAIL")


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None or value != value else format(value, spec)


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest sample with at least ``q`` of the samples at or below it."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered), math.ceil(q * len(ordered))) - 1)]


def last_line(path: str, default: str = "(no stderr)") -> str:
    """The last non-blank line of the file ``path`` (a launcher's stderr), cut to 160."""
    with contextlib.suppress(OSError), open(path, errors="replace") as file:
        lines = [line.strip() for line in file if line.strip()]
        return lines[-1][:160] if lines else default
    return default


@dataclass
class Check:
    what: str
    measured: str
    budget: str
    ok: bool | None  # None: not measured, or no budget ("-") to meet


def print_summary(
    checks: Sequence[Check], title: str = "summary (budgets apply to relaunch)"
) -> None:
    """A blank line, ``title``, then one aligned row per check with its verdict."""
    print(f"\n{title}")
    width = max(len(check.what) for check in checks)
    mwidth = max(len(check.measured) for check in checks)
    bwidth = max(len(check.budget) for check in checks)
    for check in checks:
        print(
            f"  {check.what:<{width}}  {check.measured:>{mwidth}}  {check.budget:>{bwidth}}"
            f"  {verdict(check.ok)}"
        )


@dataclass
class Launcher:
    """A launcher command line, ``prefix``, and why it cannot run (None: it can)."""

    name: str
    prefix: list[str]
    unavailable: str | None = None  # why it cannot run at all

    def argv(self, flags: Sequence[str], script: str, *args: str) -> list[str]:
        """``prefix FLAGS SCRIPT ARGS``: the same torchrun flags for both launchers."""
        return [*self.prefix, *flags, script, *args]


L = TypeVar("L", bound=Launcher)


@dataclass
class Bench(Generic[L]):
    """Shared state: the temporary directory, the environment, the two launchers, and what
    the runs left behind (``collect`` after each run)."""

    tmp: str
    env: dict[str, str]
    relaunch: L
    torchrun: L
    mark: str = ""
    orphans: bool = False  # this process is a child subreaper: every child left is an orphan
    leftovers: list[str] = field(default_factory=list)

    def launchers(self) -> list[L]:
        return [self.relaunch, self.torchrun]

    def script(self, name: str) -> str:
        """The worker program ``name`` (benchmarks/workers/NAME)."""
        return worker(name)

    def keep(self) -> Collection[int]:
        """Children of ours that are not leftovers of a run (an etcd member)."""
        return ()

    def leaks(self) -> list[str]:
        """Kill (by pid) and describe what the last run left behind (for every side alike)."""
        return collect_leaks(self.mark, ORPHAN_GRACE_S, orphans=self.orphans, keep=self.keep())

    def collect(self, side: str = "") -> None:
        self.leftovers += self.leaks()


def worker(name: str) -> str:
    """The path of the worker program benchmarks/workers/``name``."""
    return os.path.join(WORKERS, name)


# -- processes ---------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone); reaps it if it is our zombie."""
    return pid_alive(pid, reap=True)


# -- alternating repetitions -------------------------------------------------------------------


def alternate(sides: list[str], rep: int) -> list[str]:
    """Rotate the order each repetition, so that no side always runs first."""
    k = rep % len(sides) if sides else 0
    return sides[k:] + sides[:k]


def run_alternating(
    sides: Mapping[str, Callable[..., Any]],
    reps: dict[str, int],
    errors: dict[str, str],
    after_each: Callable[[str], None],
    warmup: bool = False,
) -> dict[str, list[Any]]:
    """``reps[side]`` runs of each side, interleaved, each called with its repetition number;
    with ``warmup``, after one untimed run of each (repetition -1). A side that fails once is
    dropped; ``after_each(side)`` runs after every run (the orphan collection)."""
    samples: dict[str, list[Any]] = {side: [] for side in sides}
    first = -1 if warmup else 0
    for rep in range(first, max(reps.values(), default=0)):
        for side in alternate(list(sides), rep):
            if side in errors or len(samples[side]) >= reps[side]:
                continue
            try:
                result = sides[side](rep)
                if rep >= 0:
                    samples[side].append(result)
            except BenchError as exc:
                errors[side] = str(exc)
                log(f"  {side}: {exc}")
            after_each(side)
    return samples


# -- the run: directory, environment, launchers, header ----------------------------------------


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[str]:
    """A fresh temporary directory, removed with everything in it at the end."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def add_launcher_options(parser: argparse.ArgumentParser, bytecode_help: str) -> None:
    """--no-torchrun, --relaunch, --torchrun and --no-bytecode-cache."""
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
    parser.add_argument("--no-bytecode-cache", action="store_true", help=bytecode_help)


def prepare(tmp: str, mark: str, bytecode_cache: bool) -> dict[str, str]:
    """The environment for every launcher and worker, marked with ``mark`` (the leak check)."""
    os.mkdir(os.path.join(tmp, "tmp"))
    # Same environment for every side. TMPDIR keeps the launchers' log directories inside
    # ours; PYTHONUNBUFFERED makes torchrun's tee reach a pipe at once, as on a terminal.
    env = {
        **os.environ,
        "TMPDIR": os.path.join(tmp, "tmp"),
        "PYTHONUNBUFFERED": "1",
        MARK_VAR: mark,
    }
    if bytecode_cache:
        # Cache bytecode as an installed package would, even where PYTHONDONTWRITEBYTECODE
        # is set and the sources have no __pycache__ (an editable install): in a tree of
        # our own, so that nothing is written next to the sources. The warm-up runs fill it.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
    return env


def find_torchrun(prefix: list[str]) -> str | None:
    """None when the torchrun command is usable; else why not."""
    if prefix[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
        if probe.returncode != 0:
            return "import torch fails"
    return None


def make_launchers(opts: argparse.Namespace, launcher: Callable[..., L]) -> tuple[L, L]:
    """(relaunch, torchrun) from the options, as ``launcher(name, prefix, unavailable=...)``."""
    torchrun_prefix = shlex.split(opts.torchrun)
    relaunch = launcher(RELAUNCH, shlex.split(opts.relaunch))
    unavailable = getattr(opts, "no_torchrun_reason", None)
    if unavailable is None and opts.no_torchrun:
        unavailable = "--no-torchrun"
    elif unavailable is None:
        unavailable = find_torchrun(torchrun_prefix)
    torchrun = launcher(TORCHRUN, torchrun_prefix, unavailable=unavailable)
    return relaunch, torchrun


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


def torch_version() -> str | None:
    """torch's version where ``import torch`` works, else None."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def header(name: str, opts: argparse.Namespace, launchers: bool) -> dict[str, Any]:
    """Python, CPUs, date, relaunch, torchrun, bytecode setting, load average: printed, and
    returned for the JSON results."""
    info: dict[str, Any] = {
        "benchmark": name,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "relaunch": relaunch_source(),
        "load_average": load_average(),
        "quick": opts.quick,
    }
    print(f"{name}: python {info['python']}, {info['cpus']} CPUs, {info['date']}")
    if launchers:
        print(f"  relaunch: {opts.relaunch} ({info['relaunch']})")
        torchrun = opts.torchrun + (
            f" (not run: {opts.no_torchrun_reason})" if opts.no_torchrun_reason else ""
        )
        print(f"  torchrun: {torchrun}")
        info["torchrun"] = torchrun
        cached = "as the environment has it" if opts.no_bytecode_cache else "cached (own prefix)"
        print(f"  bytecode: {cached}")
    else:
        print(f"  relaunch: {info['relaunch']}")
    print(f"  load average: {info['load_average']}" + ("; --quick" if opts.quick else ""))
    return info


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Context:
    """What a benchmark's ``run`` gets: its options, a temporary directory removed at the end,
    the environment (with the leak mark), and ``data`` for the JSON results."""

    name: str
    opts: argparse.Namespace
    tmp: str
    env: dict[str, str]
    mark: str
    orphans: bool  # adopted orphans count as leftovers (see ORPHANS)
    data: dict[str, Any] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    keep: set[int] = field(default_factory=set)  # children of ours that are not leftovers

    def launchers(self, launcher: Callable[..., L]) -> tuple[L, L]:
        """(relaunch, torchrun) from the options (see ``make_launchers``)."""
        return make_launchers(self.opts, launcher)

    def bench(
        self, cls: Callable[..., Any], relaunch: Launcher, torchrun: Launcher, **kw: Any
    ) -> Any:
        """A ``Bench`` (subclass) sharing this run's directory, environment and leftovers."""
        return cls(
            self.tmp,
            self.env,
            relaunch,
            torchrun,
            mark=self.mark,
            orphans=self.orphans,
            leftovers=self.leftovers,
            **kw,
        )

    def collect(self, keep: Collection[int] = ()) -> list[str]:
        """Kill (by pid) and note what the runs so far left behind; returns it."""
        keep = self.keep.union(keep)
        killed = collect_leaks(self.mark, ORPHAN_GRACE_S, orphans=self.orphans, keep=keep)
        self.leftovers += killed
        return killed


def load(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{name}")


def parser_for(name: str, module: ModuleType) -> argparse.ArgumentParser:
    doc = (module.__doc__ or name).strip()
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {name}",
        description=doc.splitlines()[0],
        epilog="See benchmarks/README.md for what each figure means.",
    )
    parser.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help=f"where the results go (default: {os.path.relpath(RESULTS)}/{name}.json, or "
        f"{name}-quick.json with --quick)",
    )
    if getattr(module, "LAUNCHERS", True):
        add_launcher_options(parser, "run with the environment's bytecode settings as they are")
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    return parser


def main(name: str, argv: Sequence[str]) -> int:
    """Run benchmark ``name`` with its command-line ``argv``; the exit status."""
    module = load(name)
    parser = parser_for(name, module)
    if "--quick" in argv:
        parser.set_defaults(**getattr(module, "QUICK", {}))
    opts = parser.parse_args(list(argv))
    if opts.json is None:
        opts.json = os.path.join(RESULTS, f"{name}-quick.json" if opts.quick else f"{name}.json")
    launchers = getattr(module, "LAUNCHERS", True)
    if launchers:
        opts.no_torchrun_reason = (
            "--no-torchrun" if opts.no_torchrun else find_torchrun(shlex.split(opts.torchrun))
        )
    started = time.perf_counter()
    orphans = getattr(module, "ORPHANS", True) and become_subreaper()
    mark = uuid.uuid4().hex
    with temp_dir(f"relaunch-bench-{name}-") as tmp:
        env = prepare(tmp, mark, not getattr(opts, "no_bytecode_cache", False))
        ctx = Context(name, opts, tmp, env, mark, orphans)
        info = header(name, opts, launchers)
        if not orphans:
            print("  leftovers: marked processes only (not a child subreaper)")
        try:
            checks = module.run(ctx)
        finally:
            ctx.collect()
    leftovers = ctx.leftovers
    checks.append(Check("processes left behind", str(len(leftovers)), "0", not leftovers))
    print_summary(checks)
    for leftover in leftovers:
        print(f"  left behind (killed): {leftover}")
    seconds = time.perf_counter() - started
    print(f"total time {seconds:.1f} s")
    # A figure without a budget ("-") informs; one with a budget fails unless it was met.
    status = 0 if all(check.ok or check.budget == "-" for check in checks) else 1
    write_json(
        opts.json,
        {
            **info,
            "options": {k: v for k, v in vars(opts).items() if k != "json"},
            "checks": [asdict(check) for check in checks],
            "leftovers": leftovers,
            "data": ctx.data,
            "seconds": round(seconds, 1),
            "status": status,
        },
    )
    return status


def write_json(path: str, results: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(results, file, indent=1, default=str)
        file.write("\n")
    log(f"results: {os.path.relpath(path)}")
