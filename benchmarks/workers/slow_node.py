"""A worker for the eviction test and benchmark: python slow_node.py OUT TOTAL.

Every rank steps every 20 ms, reporting its steps (past TOTAL while others catch up); the
ranks of a node whose agent has SLOW_NODE=1 in its environment step every 100 ms (asynchronous
work: no collective). A rank
resumes from the step it wrote last (OUT/step.<rank>), as kept state would have it, so a
spare that takes a node's place goes on from where it was; every rank stops once every rank
of the world reached TOTAL, or OUT/stop exists. Each rank writes OUT/start.<rank>.<pid>: the
time it started, and SLOW_NODE.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import relaunch


def main() -> int:
    out, total = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = out / f"step.{rank}"
    step = int(mine.read_text() or 0) if mine.exists() else 0
    (out / f"start.{rank}.{os.getpid()}").write_text(f"{time.time()!r} {os.environ['SLOW_NODE']}")
    pause = 0.1 if os.environ["SLOW_NODE"] == "1" else 0.02
    while not (out / "stop").exists():
        if step >= total and all(_step(out, r) >= total for r in range(world)):
            break
        step += 1  # on past TOTAL while others catch up: a rank that stopped would look slow
        relaunch.report_progress(step)
        tmp = out / f".step.{rank}"
        tmp.write_text(str(step))
        tmp.replace(mine)
        time.sleep(pause)
    return 0


def _step(out: pathlib.Path, rank: int) -> int:
    try:
        return int((out / f"step.{rank}").read_text() or 0)
    except FileNotFoundError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
