"""A worker for test_state's loss of nodes at once: ``state_ring_worker.py OUT``.

Each rank keeps ``{"rank", "step", "pad"}`` with ``save_state`` (its own: not replicated)
every ``RING_STEP_S`` s (default 0.05; ``pad``: ``RING_PAD_MB`` MiB, default none) and
publishes ``OUT/agent.{rank}`` (its agent's pid) and ``OUT/step.{rank}`` (its newest saved
step); each start appends the step it resumed from (-1: none) to ``OUT/resumed.{rank}``. The
ranks move in lockstep, as a collective would hold them: a rank begins step ``s`` once every
rank saved ``s - 1`` (so a rank whose peers died waits), and none saves while ``OUT/pause``
exists. ``OUT/dir.{rank}`` names its agent's state directory. It ends at the step ``OUT/stop``
names (or at once, when it is past it).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import relaunch

out, rank = pathlib.Path(sys.argv[1]), int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
pause = float(os.environ.get("RING_STEP_S", "0.05"))
pad = bytes(int(float(os.environ.get("RING_PAD_MB", "0")) * (1 << 20)))


def publish(name: str, text: str) -> None:
    (out / f"{name}.tmp").write_text(text)
    os.replace(out / f"{name}.tmp", out / name)


def read(name: str) -> str:
    return (out / name).read_text()


def saved(other: int) -> int:
    return int(read(f"step.{other}")) if (out / f"step.{other}").exists() else -1


got = relaunch.load_state()
if got is not None and (got[1]["rank"], got[1]["step"]) != (rank, got[0]):
    sys.exit(f"rank {rank} loaded another rank's state: {got}")
start = 0 if got is None else got[0] + 1
with open(out / f"resumed.{rank}", "a") as resumed:
    resumed.write(f"{start - 1}\n")
publish(f"agent.{rank}", str(os.getppid()))
publish(f"dir.{rank}", os.environ["RELAUNCH_STATE_DIR"])
step = start
while not (out / "stop").exists() or step < int(read("stop")):
    while min(saved(other) for other in range(world)) < step - 1 or (out / "pause").exists():
        time.sleep(0.005)  # the step's collective, waiting for the others; or paused
    relaunch.save_state({"rank": rank, "step": step, "pad": pad}, step)
    publish(f"step.{rank}", str(step))
    step += 1
    time.sleep(pause)
