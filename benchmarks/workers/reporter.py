"""``sys.argv[1]`` steps ``sys.argv[2]`` s apart, calling ``report_progress`` (``sys.argv[3]``
is ``report``) or an empty function at each; prints ``CALL rank R <mean ns> ns``."""

import os
import sys
import time

from relaunch import report_progress


def floor(step, total=None, desc=None):
    pass


total, period = int(sys.argv[1]), float(sys.argv[2])
call = report_progress if sys.argv[3] == "report" else floor
clock, spent = time.perf_counter, 0.0
t0 = time.monotonic()
for i in range(1, total + 1):
    delay = t0 + i * period - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    started = clock()
    call(i, total, desc="steps")
    spent += clock() - started
print(f"CALL rank {os.environ['LOCAL_RANK']} {spent / total * 1e9:.0f} ns", flush=True)
