"""A worker's error file is read by its agent (``procs.process_failure.read_error_file``): the
worker writes it, so what it leaves there is outside input to the agent.

Before: JSON nested deeper than the parser reads ended the agent's monitor thread
(``RecursionError``: "relaunch-monitor thread failed"); a FIFO at the error file's name hung the
agent for good (SIGTERM did not end it); a 1 GiB sparse file was read whole (8 s, over 1 GiB of
the agent's memory). Now each is one warning, and the failure is reported as one without an
error file: exit 1, no traceback, within seconds, in little memory.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck

pytestmark = pytest.mark.timeout(60)

WORKER = textwrap.dedent(
    """
    import os, sys
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    if sys.argv[1] == "deep":
        with open(path, "w") as file:
            file.write("[" * 100_000)
    elif sys.argv[1] == "fifo":
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path)
    else:
        with open(path, "wb") as file:
            file.truncate(1 << 30)
    sys.exit(1)
    """
)

#: Runs the agent and prints the largest resident size of it and its workers, in KiB.
MEASURED = (
    "import resource, subprocess, sys; "
    "code = subprocess.run([sys.executable, '-m', 'relaunch', *sys.argv[1:]]).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
    "sys.exit(code)"
)


@pytest.mark.parametrize("left", ["deep", "fifo", "huge"])
def test_what_a_worker_leaves_as_its_error_file_neither_hangs_nor_crashes_the_agent(
    tmp_path: pathlib.Path, leaks: LeakCheck, left: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = subprocess.run(
        [sys.executable, "-c", MEASURED, "--nproc-per-node", "1", str(script), left],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=30,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "thread failed" not in done.stderr, done.stderr
    assert any("cannot read error file" in line for line in lines), done.stderr
    assert any("run summary: failed" in line for line in lines), done.stderr
    peak_mib = int(lines[-1]) / 1024
    assert peak_mib < 200, f"the agent peaked at {peak_mib:.0f} MiB"
