"""Write ``sys.argv[1]`` lines ``{i} {time.time_ns()}``, ``sys.argv[2]`` s apart, one write()
each (line latency)."""

import sys
import time

count, gap = int(sys.argv[1]), float(sys.argv[2])
write = sys.stdout.write
for i in range(count):
    write(f"{i} {time.time_ns()}\n")
    time.sleep(gap)
