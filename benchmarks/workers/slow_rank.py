"""A worker for the straggler and status tests and benchmark:
python slow_rank.py OUT SLOW_RANK [FAIL_RANK].

Every rank reports a step every 20 ms, but global rank SLOW_RANK every 100 ms; each writes
OUT/start.<rank> with its start time, and all stop once OUT/stop exists. FAIL_RANK, if given,
exits 3 at its first start (OUT/failed marks it done), spending one restart of the job.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import relaunch


def main() -> int:
    out, slow = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    fail = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    rank = int(os.environ["RANK"])
    if rank == fail and not (out / "failed").exists():
        (out / "failed").touch()
        return 3
    (out / f"start.{rank}").write_text(repr(time.time()))
    pause = 0.1 if rank == slow else 0.02
    step = 0
    while not (out / "stop").exists():
        step += 1
        relaunch.report_progress(step)
        time.sleep(pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())
