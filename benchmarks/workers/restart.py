"""First attempt: write time.time() to ``sys.argv[1]`` and fail at once, printing nothing.
The restart: print ``started <time.time()>`` first thing (failure -> restart)."""

import os
import sys
import time

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    with open(sys.argv[1], "w") as file:
        file.write(repr(time.time()))
    os._exit(1)
print(f"started {time.time()!r}", flush=True)
