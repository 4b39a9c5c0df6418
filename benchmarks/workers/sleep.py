"""A worker that sleeps ``sys.argv[1]`` seconds (default 1): the RSS measurement."""

import sys
import time

time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
