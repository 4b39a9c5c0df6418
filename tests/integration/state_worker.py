"""A worker for tests/integration/test_state.py: keeps its state with relaunch.save_state.

``state_worker.py OUT MODE STEPS [KILL_AT]``: resumes from ``load_state()``, then runs steps up
to ``STEPS``, saving after each; writes ``OUT/resumed.{attempt}.{rank}`` (the step it resumed
from, -1: none) and ``OUT/final.{rank}`` (the state at the end). MODE:

- ``kill``: in attempt 0, rank 1 SIGKILLs itself once every rank saved step ``KILL_AT``, and
  the other ranks wait there (as a collective would hold them) until stopped;
- ``jit``: in attempt 0, rank 1 saves each step and exits 3 at step ``KILL_AT``; rank 0 saves
  nothing but asks ``failure_pending()`` each step, and once told saves its last step
  (``replicated``), which both resume from;
- ``callback``: as ``jit``, but rank 0 saves from ``on_failure_pending``'s callback;
- ``section``, ``silent``: as ``callback``, but at step ``KILL_AT`` rank 1 hangs instead of
  exiting: in a ``relaunch.section`` of 0.5 s, or silent (no output, progress or timer) while
  rank 0 reports progress each step (for ``--hang-timeout``);
- ``exit``: runs to ``KILL_AT`` and, once every rank saved it, exits 1 (a job that fails, to
  be requeued);
- ``big``: saves ``KILL_AT`` MiB once.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

import relaunch

out, mode, steps = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
kill_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])

if mode == "big":
    relaunch.save_state(bytes(kill_at << 20), 0)
    sys.exit(0)

hang = mode if mode in ("section", "silent") else None
got = relaunch.load_state()
start, state = (0, {"rank": rank, "sum": 0}) if got is None else (got[0] + 1, got[1])
(out / f"resumed.{attempt}.{rank}").write_text(str(-1 if got is None else got[0]))
if mode in ("callback", "section", "silent") and attempt == 0 and rank == 0:
    # Saved from relaunch's thread when told, while the main thread goes on stepping.
    kept = {"now": (state, start - 1)}  # one value: the thread reads a whole pair

    def save_now() -> None:
        now, at = kept["now"]
        (out / "jit").write_text(str(at))
        relaunch.save_state(now, at, replicated=True)

    relaunch.on_failure_pending(save_now)
mode = "jit" if mode in ("callback", "section", "silent") else mode
for step in range(start, steps):
    if mode == "jit" and attempt == 0:
        if rank == 0 and step == kill_at:
            (out / "ready").write_text("")  # rank 0 is as far as rank 1 will get
        if rank == 1 and step == kill_at:
            while not (out / "ready").exists():
                time.sleep(0.005)
            if hang == "section":
                with relaunch.section("step", timeout=0.5):
                    time.sleep(60)  # hung past its section's deadline
            elif hang == "silent":
                time.sleep(60)  # hung, without a sign of life
            sys.exit(3)
        if rank == 0 and "kept" not in globals() and relaunch.failure_pending():
            (out / "jit").write_text(str(step - 1))  # first: the save ends this worker's time
            relaunch.save_state(state, step - 1, replicated=True)
            time.sleep(60)  # stopped by the agent
        time.sleep(0.01)
    if hang == "silent" and (rank == 0 or attempt > 0):
        relaunch.report_progress(step)  # alive (rank 1 is silent in attempt 0)
    state = {"rank": state["rank"], "sum": state["sum"] + step, "step": step}
    if "kept" in globals():
        kept["now"] = (state, step)
    if mode != "jit" or attempt > 0 or rank == 1:
        relaunch.save_state(state, step)
    if mode == "kill" and attempt == 0 and step == kill_at:
        (out / f"saved.{rank}").write_text("")
        if rank == 1:  # once every rank has saved this step, as a collective would hold them
            world = int(os.environ["WORLD_SIZE"])
            while len(list(out.glob("saved.*"))) < world:
                time.sleep(0.005)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # held, as by a collective with the killed rank
    if mode == "exit" and step == kill_at:
        (out / f"saved.{rank}").write_text("")
        while len(list(out.glob("saved.*"))) < int(os.environ["WORLD_SIZE"]):
            time.sleep(0.005)  # every rank saved this step, as a collective would see to
        sys.exit(1)
(out / f"final.{rank}").write_text(repr(state))
