"""A tqdm-like bar on stderr: ``sys.argv[1]`` refreshes at ``sys.argv[2]`` Hz, and
``sys.argv[3]`` log lines on stdout per refresh (0: one a second)."""

import os
import sys
import time

rank = int(os.environ["LOCAL_RANK"])
total, hz, per_refresh = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
per_second = max(1, round(hz))
err, last, logged = sys.stderr, 0, 0
t0 = time.monotonic()
for i in range(1, total + 1):
    delay = t0 + i / hz - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    elapsed = time.monotonic() - t0
    filled = 20 * i // total
    text = (
        f"rank {rank}: {100 * i // total:3d}%|{'#' * filled}{' ' * (20 - filled)}| "
        f"{i}/{total} [{elapsed:05.2f}s, {i / elapsed:.1f}it/s]"
    )
    err.write("\r" + text + " " * max(last - len(text), 0))
    err.flush()
    last = len(text)
    for _ in range(per_refresh if per_refresh else i % per_second == 0):
        logged += 1
        print(f"log rank {rank} line {logged}", flush=True)
err.write("\n")
err.flush()
