"""Graceful stop: save a checkpoint when relaunch asks, resume from it on the next start.

    relaunch --nproc-per-node 2 --tee 3 examples/checkpoint_on_stop.py
    (press Ctrl-C, or `kill -TERM <relaunch pid>`; run it again: it resumes)

On the first SIGTERM or Ctrl-C, relaunch raises a stop request that ``stop_requested()`` reads
(cheap, never blocking) and waits up to ``--shutdown-timeout`` for the workers to exit; a second
signal stops them at once. ``report_progress`` feeds relaunch's per-node progress bar.
"""

import json
import os
import time

import relaunch

STEPS = 500


def checkpoint_path() -> str:
    directory = os.environ.get("CHECKPOINT_DIR", ".")
    return os.path.join(directory, f"ckpt-rank{os.environ['RANK']}.json")


def load() -> int:
    try:
        with open(checkpoint_path()) as file:
            return int(json.load(file)["step"])
    except FileNotFoundError:
        return 0


def save(step: int) -> None:
    path = checkpoint_path()
    with open(path + ".tmp", "w") as file:
        json.dump({"step": step}, file)
    os.replace(path + ".tmp", path)  # atomic: a crash never leaves half a checkpoint


def main() -> None:
    start = load()
    if start:
        print(f"resuming at step {start}")
    for step in range(start, STEPS):
        time.sleep(0.02)  # one training step
        relaunch.report_progress(step + 1, STEPS, "train")
        if relaunch.stop_requested():  # at a step boundary: save, and leave cleanly
            save(step + 1)
            print(f"stop requested: saved step {step + 1}, exiting")
            return
    save(STEPS)
    print("finished")


if __name__ == "__main__":
    main()
