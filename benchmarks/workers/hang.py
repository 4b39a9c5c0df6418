"""A worker for the resilience tests and benchmark: python hang.py OUT MODE HUNG_RANK.

In the first attempt, global rank HUNG_RANK hangs inside ``stuck_in_step`` after setting a
deadline (MODE: ``given``, a section timeout of 1 s; ``learned``, five quick runs of the section
first; ``heartbeat``, a heartbeat due within 1 s) and writes the deadline (``time.time()``) to
OUT/deadline; every other rank waits in ``waiting_in_collective``, as a rank waits for a peer.
Every rank writes OUT/start.<attempt>.<rank> with the time it started; later attempts exit 0.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import relaunch
from relaunch.core.sections import learned_bound


def stuck_in_step(out: pathlib.Path, mode: str) -> None:
    if mode == "heartbeat":
        relaunch.heartbeat(timeout=1.0)
        (out / "deadline").write_text(repr(time.time() + 1.0))
        time.sleep(300)
    if mode == "learned":
        longest = 0.0
        for _ in range(5):
            with relaunch.section("step"):
                began = time.time()
                time.sleep(0.02)
                longest = max(longest, time.time() - began)
    timeout = 1.0 if mode == "given" else None
    with relaunch.section("step", timeout=timeout):
        bound = 1.0 if timeout else learned_bound(5, longest)
        assert bound is not None
        (out / "deadline").write_text(repr(time.time() + bound))
        time.sleep(300)


def waiting_in_collective() -> None:
    time.sleep(300)


def main() -> int:
    out, mode, hung_rank = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    (out / f"start.{attempt}.{rank}").write_text(repr(time.time()))
    if attempt > 0:
        return 0
    if rank == hung_rank:
        stuck_in_step(out, mode)
    else:
        waiting_in_collective()
    return 0


if __name__ == "__main__":
    sys.exit(main())
