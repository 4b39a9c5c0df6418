"""A synchronous gloo training loop with a slow node, for the straggler and eviction tests and
benchmarks: python sync_slow_node.py OUT SLOW_NODE SLOW_AFTER [COMPUTE_S [TOTAL]].

SLOW_NODE is a group rank, or ``env``: the ranks whose agent has ``SLOW_NODE=1`` in its
environment are slow (a machine that is slow, wherever the rendezvous places it).

Every step, each rank reports its progress, computes inside ``relaunch.section("compute")``
(COMPUTE_S seconds, 0.02 by default; five times that on the slow ranks from step SLOW_AFTER on)
and all-reduces a tensor, so that every rank steps at the slowest one's pace. The ranks resume
from the last step any of them wrote (OUT/step.<rank>), as kept state would have them, so a
spare that takes a node's place goes on where the node was. All stop at the same step once one
of them reaches TOTAL (0, the default: never) or sees OUT/stop (the flag travels in the
all-reduce).
Each rank writes OUT/start.<rank>.<pid> (the time of its first step, that step, and 1 when it
is slow), OUT/end.<rank>.<pid> (the time and step it stopped at), and the slow ranks
OUT/onset.<rank> (when their slow computing began); rank 0 writes OUT/steps.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

import relaunch


def main() -> int:
    out, slow_after = pathlib.Path(sys.argv[1]), int(sys.argv[3])
    compute = float(sys.argv[4]) if len(sys.argv) > 4 else 0.02
    total = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    if sys.argv[2] == "env":
        slow_here = os.environ.get("SLOW_NODE") == "1"
    else:
        slow_here = node == int(sys.argv[2])
    mine = out / f"step.{rank}"
    step = int(mine.read_text() or 0) if mine.exists() else 0
    dist.init_process_group("gloo")
    # A rank stopped between two steps' files may be one behind: all go on from the furthest.
    resumed = torch.tensor([step])
    dist.all_reduce(resumed, op=dist.ReduceOp.MAX)
    step = int(resumed[0])
    pid = os.getpid()
    (out / f"start.{rank}.{pid}").write_text(f"{time.time()!r} {step} {int(slow_here)}")
    flag = torch.zeros(1)
    while True:
        step += 1
        relaunch.report_progress(step)
        slow = slow_here and step >= slow_after
        if slow and not (out / f"onset.{rank}").exists():
            (out / f"onset.{rank}").write_text(repr(time.time()))
        with relaunch.section("compute"):
            time.sleep(5 * compute if slow else compute)
        flag[0] = 1.0 if (total and step >= total) or (out / "stop").exists() else 0.0
        dist.all_reduce(flag)
        (out / f".step.{rank}").write_text(str(step))
        (out / f".step.{rank}").replace(mine)
        if flag[0] > 0:
            break
    (out / f"end.{rank}.{pid}").write_text(f"{time.time()!r} {step}")
    if rank == 0:
        (out / "steps").write_text(str(step))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
