"""Time ``report_progress`` and ``stop_requested``: ``sys.argv[2]`` samples of ``sys.argv[1]``
calls each; prints ``RESULT <json>`` (ns per call, and whether the channel was mapped)."""

import json
import os
import sys
import time

import relaunch
import relaunch.worker
from relaunch import report_progress, stop_requested

calls, reps = int(sys.argv[1]), int(sys.argv[2])


def floor(step, total=None):
    pass


def timed(name, call):
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) / calls * 1e9)
    return name, samples


def loop_floor():
    for i in range(calls):
        floor(i, calls)


def loop_report():
    for i in range(calls):
        report_progress(i, calls)


def loop_report_desc():
    for i in range(calls):
        report_progress(i, calls, desc="train")


def loop_stop():
    for _ in range(calls):
        stop_requested()


results = dict(
    timed(*args)
    for args in (
        ("python call floor", loop_floor),
        ("report_progress(step, total)", loop_report),
        ("report_progress(step, total, desc)", loop_report_desc),
        ("stop_requested()", loop_stop),
    )
)
mapped = relaunch.worker._map is not None
channel = os.environ.get("RELAUNCH_CHANNEL", "")
print(
    "RESULT " + json.dumps({"results": results, "mapped": mapped, "channel": channel}), flush=True
)
