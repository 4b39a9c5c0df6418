"""Worker import cost: ``import relaunch; relaunch.report_progress(1)`` against ``pass``.

Every worker that reports progress pays for ``import relaunch``. Two commands,
``python -c "import relaunch; relaunch.report_progress(1)"`` and ``python -c pass``, run
alternately (the one that goes first alternates too), ``--reps`` times each, with bytecode
cached (``PYTHONDONTWRITEBYTECODE`` unset, a private ``PYTHONPYCACHEPREFIX`` warmed first);
the wall time of each run, medians. Budget: the import costs at most 15 ms over the floor.
Then one ``python -X importtime`` run lists the costliest modules the import adds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks import harness
from benchmarks.harness import BenchError, Check, log, median

BUDGET_MS = 15.0  # median(import) - median(pass)
IMPORT = "import relaunch; relaunch.report_progress(1)"
FLOOR = "pass"
WARMUP = 3

LAUNCHERS = False
QUICK = {"reps": 7}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=31, help="runs of each command (default 31)")
    parser.add_argument("--top", type=int, default=8, help="modules listed from -X importtime")


def timed(code: str, env: dict[str, str]) -> float:
    """Wall seconds of ``python -c CODE``."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise BenchError(f"python -c {code!r}: exit {proc.returncode}: {proc.stderr[-300:]!r}")
    return elapsed


def importtime(code: str, env: dict[str, str]) -> list[tuple[str, float, float]]:
    """(module, self ms, cumulative ms) of each import of ``python -X importtime -c CODE``."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        fields = [field.strip() for field in line.removeprefix("import time:").split("|")]
        rows.append((fields[2], int(fields[0]) / 1e3, int(fields[1]) / 1e3))
    return rows


def run(ctx: harness.Context) -> list[Check]:
    opts = ctx.opts
    env = ctx.env
    log(f"warming the bytecode cache ({WARMUP} runs), then {opts.reps} runs of each, alternating")
    for _ in range(WARMUP):
        timed(IMPORT, env)
        timed(FLOOR, env)
    sides = {"import": lambda _rep: timed(IMPORT, env), "floor": lambda _rep: timed(FLOOR, env)}
    errors: dict[str, str] = {}
    samples = harness.run_alternating(
        sides, dict.fromkeys(sides, opts.reps), errors, lambda _s: None
    )
    if errors:
        return [Check("worker import cost", "error", f"<= +{BUDGET_MS:g} ms", False)]
    ours, floor = median(samples["import"]) * 1e3, median(samples["floor"]) * 1e3
    extra = ours - floor
    print(f"\nworker import cost: wall ms of python -c CODE, medians of {opts.reps}")
    print(f"  {'python -c pass':<56} {floor:8.1f}")
    print(f"  {'python -c ' + repr(IMPORT):<56} {ours:8.1f}")
    print(f"  {'import cost':<56} {extra:+8.1f}  (budget <= +{BUDGET_MS:g} ms)")
    startup = {row[0] for row in importtime(FLOOR, env)}  # what python -c pass imports too
    rows = [row for row in importtime(IMPORT, env) if row[0] not in startup]
    print(
        f"\n-X importtime: the {opts.top} costliest of the {len(rows)} modules the import adds,"
        " by self time (ms, self / cumulative)"
    )
    top = sorted(rows, key=lambda row: -row[1])[: opts.top]
    for module, own, cumulative in top:
        print(f"  {module:<56} {own:8.2f} {cumulative:8.2f}")
    ctx.data.update(
        floor_ms=floor,
        import_ms=ours,
        extra_ms=extra,
        importtime=[{"module": m, "self_ms": s, "cumulative_ms": c} for m, s, c in top],
    )
    return [
        Check(
            "worker import cost (import - pass)",
            f"{extra:+.1f} ms",
            f"<= +{BUDGET_MS:g} ms",
            extra <= BUDGET_MS,
        )
    ]
