"""Print ``started <time.time()> rank R world W pid P``, then wait for the file ``sys.argv[1]``
(at most 120 s) and exit 0 (a node killed)."""

import os
import sys
import time

print(
    f"started {time.time()!r} rank {os.environ['RANK']} world {os.environ['WORLD_SIZE']}"
    f" pid {os.getpid()}",
    flush=True,
)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
