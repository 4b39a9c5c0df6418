"""A worker for the goodput ledger's test: ``goodput_worker.py OUT FAIL_AT [quiet]``.

Steps of 0.3 s, reported with ``report_progress``, state saved every 5 steps; ``quiet``: no
progress reported, state saved every step. In attempt 0, at the start of step FAIL_AT, once
rank 0 is there too, rank 1 writes ``OUT/failed`` (the time) and exits 4, and the other ranks
wait there, as a collective would hold them. In attempt 1, each rank writes
``OUT/back.{rank}`` when it begins step FAIL_AT again: the job is then where it was when it
failed. (Not when it completes that step: the step's own time, a sleep that overshoots and a
save under load, is no part of what the restart lost, and made the sum uncertain by tens of
ms.)"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import relaunch

STEP_SECONDS = 0.3
out, fail_at = pathlib.Path(sys.argv[1]), int(sys.argv[2])
quiet = sys.argv[3:] == ["quiet"]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
got = relaunch.load_state()
for step in range(0 if got is None else got[0] + 1, fail_at + 2):
    if attempt == 0 and step == fail_at:
        (out / f"at.{rank}").touch()
        if rank == 1:
            # Both ranks at the failing step (their saves the same): as a collective holds them.
            deadline = time.monotonic() + 30
            while not (out / "at.0").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            (out / "failed").write_text(repr(time.time()))
            os._exit(4)
        time.sleep(60)  # stopped by relaunch
    if attempt == 1 and step == fail_at:
        (out / f"back.{rank}").write_text(repr(time.time()))
    time.sleep(STEP_SECONDS)
    if quiet or step % 5 == 0:
        relaunch.save_state({"step": step}, step)
    if not quiet:
        relaunch.report_progress(step)
