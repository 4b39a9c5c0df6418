"""Print ``sys.argv[1]`` lines ``line {i} some payload text`` (tee throughput)."""

import sys

for i in range(int(sys.argv[1])):
    print(f"line {i} some payload text")
