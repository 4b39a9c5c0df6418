"""What the benchmark scripts share: checks and their summary, child processes (orphans adopted
as a child subreaper, liveness, killing by pid), alternating repetitions, the temporary
directory and the environment of the launchers, the launcher commands, and the header.

Not a benchmark itself: ``bench_launch.py``, ``bench_rendezvous.py`` and ``bench_procs.py``
import it from their own directory. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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


@dataclass
class Check:
    what: str
    measured: str
    budget: str
    ok: bool | None  # None: not measured


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
    """A launcher command line, ``prefix``; each benchmark adds ``argv()`` with its flags."""

    name: str
    prefix: list[str]
    unavailable: str | None = None  # why it cannot run at all


L = TypeVar("L", bound=Launcher)


@dataclass
class Bench(Generic[L]):
    """Shared state: the temporary directory, the environment, the two launchers."""

    tmp: str
    env: dict[str, str]
    relaunch: L
    torchrun: L

    def script(self, name: str) -> str:
        return os.path.join(self.tmp, name)


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


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    return "?"


def collect_orphans(grace: float = 3.0, keep: Collection[int] = ()) -> list[str]:
    """Call with no launcher running: every child of ours now is an adopted orphan. Reap those
    that exit within ``grace`` (relaunch's guardian exits when its launcher has); kill the rest,
    by pid, and return them, one line each. ``keep``: pids of children the benchmark started
    itself and still needs (a store server), never counted or killed."""
    deadline = time.monotonic() + grace
    while True:
        live = [pid for pid in our_children() if pid not in keep and alive(pid)]
        if not live:
            return []
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    killed = []
    for pid in live:
        stat = proc_stat(pid)
        killed.append(f"pid {pid} ({stat[0] if stat else '?'}) {cmdline(pid)[:80]}")
        kill_pid(pid)
    time.sleep(0.05)
    for pid in live:
        alive(pid)  # reaps the zombie
    return killed


# -- alternating repetitions -------------------------------------------------------------------


def alternate(sides: list[str], rep: int) -> list[str]:
    """Rotate the order each repetition, so that no side always runs first."""
    k = rep % len(sides) if sides else 0
    return sides[k:] + sides[:k]


def run_alternating(
    sides: dict[str, Callable[[int], Any]],
    reps: dict[str, int],
    errors: dict[str, str],
    after_each: Callable[[str], None],
    warmup: bool = False,
) -> dict[str, list]:
    """``reps[side]`` runs of each side, interleaved, each called with its repetition number;
    with ``warmup``, after one untimed run of each (repetition -1). A side that fails once is
    dropped; ``after_each(side)`` runs after every run (the orphan collection)."""
    samples: dict[str, list] = {side: [] for side in sides}
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


def prepare(tmp: str, scripts: dict[str, str], bytecode_cache: bool) -> dict[str, str]:
    """Write the worker ``scripts`` into ``tmp``; the environment for every launcher."""
    for name, text in scripts.items():
        with open(os.path.join(tmp, name), "w") as file:
            file.write(text)
    os.mkdir(os.path.join(tmp, "tmp"))
    # Same environment for every side. TMPDIR keeps the launchers' log directories inside
    # ours; PYTHONUNBUFFERED makes torchrun's tee reach a pipe at once, as on a terminal.
    env = {**os.environ, "TMPDIR": os.path.join(tmp, "tmp"), "PYTHONUNBUFFERED": "1"}
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
    torchrun = launcher(
        TORCHRUN,
        torchrun_prefix,
        unavailable="--no-torchrun" if opts.no_torchrun else find_torchrun(torchrun_prefix),
    )
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


def print_header(
    name: str, opts: argparse.Namespace, torchrun_unavailable: str | None, subreaper: bool
) -> None:
    """Python, CPUs, date; the two commands, the bytecode setting, the load average."""
    print(
        f"{name}: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(f"  relaunch: {opts.relaunch} ({relaunch_source()})")
    print(
        f"  torchrun: {opts.torchrun}"
        + (f" (not run: {torchrun_unavailable})" if torchrun_unavailable else "")
    )
    bytecode = "as the environment has it" if opts.no_bytecode_cache else "cached (own prefix)"
    print(f"  bytecode: {bytecode}")
    print(f"  load average: {load_average()}")
    if not subreaper:
        print("  note: not a child subreaper; orphans of a launcher cannot be checked")
