"""Print ``started <time.time()> rank R world W`` and exit (K agents at once)."""

import os
import time

print(
    f"started {time.time()!r} rank {os.environ['RANK']} world {os.environ['WORLD_SIZE']}",
    flush=True,
)
