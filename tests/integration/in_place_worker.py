"""A worker for tests/integration/test_in_place.py: ``in_place_worker.py OUT MODE``, its work in
a ``@relaunch.restart_in_place`` function. Each call appends ``PID RANK ATTEMPT WORLD_SIZE
RESUMED`` to ``OUT/calls.{LOCAL_RANK}`` and prints ``call PID ATTEMPT`` to its stdout. MODE, in
attempt 0 (later attempts return at once):

- ``kill``: the last rank SIGKILLs itself once every rank is in the function; the others raise
  ``ConnectionError`` once it is gone, as a collective with a dead peer would;
- ``own``: rank 0 raises ``ValueError`` that nothing else explains, while the others wait for
  ``OUT/stop`` (never written: they are stopped).
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

import relaunch

out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]


@relaunch.restart_in_place
def train() -> int:
    rank, local = int(os.environ["RANK"]), os.environ["LOCAL_RANK"]
    attempt, world = os.environ["TORCHELASTIC_RESTART_COUNT"], int(os.environ["WORLD_SIZE"])
    with open(out / f"calls.{local}", "a") as calls:
        calls.write(f"{os.getpid()} {rank} {attempt} {world} {relaunch.resumes_from(None)}\n")
    print(f"call {os.getpid()} {attempt}", flush=True)
    if attempt != "0":
        return 0
    last = world - 1
    (out / f"in.{rank}").write_text("")
    if mode == "kill":
        if rank == last:
            while not all((out / f"in.{other}").exists() for other in range(world)):
                time.sleep(0.005)
            (out / "dying").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        while not (out / "dying").exists():
            time.sleep(0.005)
        dying = int((out / "dying").read_text())
        while os.path.exists(f"/proc/{dying}") and "Z" not in _state(dying):
            time.sleep(0.005)
        raise ConnectionError(f"rank {last} is gone")
    if rank == 0:
        raise ValueError("a bug of rank 0's own")
    while not (out / "stop").exists():
        time.sleep(0.01)
    return 0


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


sys.exit(train())
