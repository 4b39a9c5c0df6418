"""A synchronous gloo training loop with a slow node, for the straggler test and benchmark:
python sync_slow_node.py OUT SLOW_NODE SLOW_AFTER [COMPUTE_S].

SLOW_NODE is a group rank, or ``env``: the ranks whose agent has ``SLOW_NODE=1`` in its
environment are slow (a machine that is slow, wherever the rendezvous places it).

Every step, each rank reports its progress, computes inside ``relaunch.section("compute")``
(COMPUTE_S seconds, 0.02 by default; five times that on the ranks of group rank SLOW_NODE from
step SLOW_AFTER on) and all-reduces a tensor, so that every rank steps at the slowest one's
pace. Each rank writes OUT/start.<rank> (its first step's time) and the ranks of the slow node
OUT/onset.<rank> (when their slow computing began); all stop at the same step once one of them
sees OUT/stop (the flag travels in the all-reduce), and rank 0 writes OUT/steps.
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
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    if sys.argv[2] == "env":
        slow_here = os.environ.get("SLOW_NODE") == "1"
    else:
        slow_here = node == int(sys.argv[2])
    dist.init_process_group("gloo")
    (out / f"start.{rank}").write_text(repr(time.time()))
    flag = torch.zeros(1)
    step = 0
    while True:
        step += 1
        relaunch.report_progress(step)
        slow = slow_here and step >= slow_after
        if slow and step == slow_after:
            (out / f"onset.{rank}").write_text(repr(time.time()))
        with relaunch.section("compute"):
            time.sleep(5 * compute if slow else compute)
        flag[0] = 1.0 if (out / "stop").exists() else 0.0
        dist.all_reduce(flag)
        if flag[0] > 0:
            break
    if rank == 0:
        (out / "steps").write_text(str(step))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
