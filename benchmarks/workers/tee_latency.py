"""A launcher whose stdout is the benchmark's pipe: ``start_processes`` of one stamped_lines.py
worker with its stdout tee'd (line latency). Arguments: LOG_DIR COUNT GAP MARK."""

import os
import sys

from relaunch import Std, start_processes

log_dir, count, gap, mark = sys.argv[1:5]
script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stamped_lines.py")
ctx = start_processes(
    "lat",
    sys.executable,
    {0: ("-u", script, count, gap)},
    {0: {"RELAUNCH_TEST_MARK": mark}},
    log_dir,
    tee=Std.OUT,
)
try:
    result = ctx.wait()
finally:
    ctx.close()
sys.exit(0 if result is not None and not result.is_failed() else 1)
