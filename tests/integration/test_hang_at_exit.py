"""A worker that hangs at interpreter exit, after its last output line, as one whose gloo process
group's destructor waits for a peer can (torchrun waited more than 10 minutes for such a rank):
``--hang-timeout`` ends the run, and the report says it hung at exit, with the stuck threads'
stacks."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import LeakCheck, wait_until

from relaunch.core.run.failures import AT_EXIT

pytestmark = pytest.mark.timeout(60)

HANG_TIMEOUT = 2.0
#: Start-up, the check's period and the SIGABRT dump: seconds, not the 10 minutes torchrun took.
MARGIN = 10.0

# Rank 1 starts a non-daemon thread that never ends, prints its last line and returns: the
# interpreter then waits at exit (threading._shutdown) for that thread, with no more output.
JOB = """\
import os, threading
def wait_for_a_peer_that_never_comes():
    threading.Event().wait()
if os.environ["RANK"] == "1":
    threading.Thread(target=wait_for_a_peer_that_never_comes).start()
print("rank", os.environ["RANK"], "done", flush=True)
"""


def start(tmp_path, leaks: LeakCheck, *flags: str) -> subprocess.Popen[str]:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    return subprocess.Popen(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", "--tee", "1", *flags, str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(),
    )


def test_without_a_hang_timeout_the_worker_never_exits(tmp_path, leaks: LeakCheck) -> None:
    launcher = start(tmp_path, leaks)
    assert launcher.stdout is not None and launcher.stderr is not None
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [
        threading.Thread(target=stdout.extend, args=(launcher.stdout,), daemon=True),
        threading.Thread(target=stderr.extend, args=(launcher.stderr,), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        # Counted from the ranks' last lines, not from the launch: on a loaded machine the
        # start alone can take longer than the hang timeout would have been.
        wait_until(lambda: len(stdout) == 2, timeout=30, what="both ranks' last line")
        with pytest.raises(subprocess.TimeoutExpired):
            launcher.wait(timeout=HANG_TIMEOUT + 1)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        for reader in readers:
            reader.join(timeout=10)
        launcher.stdout.close()
        launcher.stderr.close()
    assert launcher.returncode == 128 + signal.SIGTERM, "".join(stderr)
    assert sorted(stdout) == ["[default0]:rank 0 done\n", "[default1]:rank 1 done\n"]


def test_hang_timeout_ends_a_worker_hung_at_exit_and_says_so(tmp_path, leaks: LeakCheck) -> None:
    began = time.monotonic()
    launcher = start(tmp_path, leaks, "--hang-timeout", f"{HANG_TIMEOUT:g}")
    try:
        stdout, stderr = launcher.communicate(timeout=HANG_TIMEOUT + MARGIN)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    took = time.monotonic() - began
    assert launcher.returncode == 1, stderr
    assert HANG_TIMEOUT <= took < HANG_TIMEOUT + MARGIN
    assert sorted(stdout.splitlines()) == ["[default0]:rank 0 done", "[default1]:rank 1 done"]
    report = stderr[stderr.index("Root cause") :]
    assert "rank 1 (local_rank 1" in report and "killed by SIGABRT" in report
    assert re.search(
        r"hung: no output, progress or timer activity for [\d.]+s after its last output line "
        r"'rank 1 done' \(--hang-timeout 2\)",
        report,
    )
    assert AT_EXIT in report
    assert 'job.py", line 3 in wait_for_a_peer_that_never_comes' in report, "the stuck thread"
    assert 'threading.py", line' in report and "in _shutdown" in report, "the waiting main thread"
    assert "rank 0 (local 0): exited with code 0" in stderr, "rank 0 ended on its own"
