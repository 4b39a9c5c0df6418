"""The event log (``--event-log-handler file:PATH``): lines a reader can follow while the job runs,
one per event as it happens, in the schema of docs/events.md."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from conftest import LeakCheck, wait_until

JOB = """
    import os, pathlib, sys, time
    out = pathlib.Path(sys.argv[1])
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        sys.exit(3)
    while not (out / "stop").exists():
        time.sleep(0.01)
"""


def events(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def states(path: pathlib.Path) -> list[tuple[str, str]]:
    return [(e["source"], e["metadata"]["state"]) for e in events(path)]


@pytest.mark.timeout(60)
def test_events_can_be_followed_while_the_job_runs(
    tmp_path: pathlib.Path, leaks: LeakCheck
) -> None:
    job, log = tmp_path / "job.py", tmp_path / "events.jsonl"
    job.write_text(textwrap.dedent(JOB))
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "relaunch", "--nproc-per-node", "2", "--max-restarts", "1"),
            *("--event-log-handler", f"file:{log}", str(job), str(tmp_path)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )
    try:
        # Seen while the job runs: the start, the restart and its cause, the second start, and
        # what the restart cost (at once: workers that report no progress are back once started).
        running = [
            ("AGENT", "HEALTHY"),
            ("AGENT", "RESTARTING"),
            ("AGENT", "HEALTHY"),
            ("AGENT", "RESTART_COST"),
        ]
        wait_until(lambda: states(log) == running, timeout=30, what="the events of the restart")
        assert agent.poll() is None
        started, restarting, again, cost = events(log)
        lost = json.loads(cost["metadata"]["metadata"])["lost_seconds"]
        assert cost["metadata"]["agent_restarts"] == 1 and lost["recomputation"] == 0
        inner = json.loads(restarting["metadata"]["metadata"])
        assert inner["cause"] == "worker_failed"
        assert "rank 1 exited with code 3" in restarting["metadata"]["raw_error"]
        assert json.loads(again["metadata"]["metadata"])["rendezvous_seconds"] >= 0
        assert again["metadata"]["agent_restarts"] == 1
        assert started["name"] == "torchelastic.worker.status.HEALTHY"
        times = [json.loads(e["metadata"]["metadata"])["time"] for e in events(log)]
        assert times == sorted(times) and times[-1] <= time.time()
    finally:
        (tmp_path / "stop").touch()
    _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    # Then, as torchelastic writes them at the end: each worker's, then the agent's.
    assert states(log)[4:] == [
        ("WORKER", "SUCCEEDED"),
        ("WORKER", "SUCCEEDED"),
        ("AGENT", "SUCCEEDED"),
    ]
