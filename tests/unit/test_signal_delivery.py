"""Signals reach the code that waits for them: a child's end reaches the main thread (the
replica groups' supervisor waits for it in ``sigwaitinfo``), never a helper thread that would
discard it.

Run in a fresh interpreter: pytest's own threads (xdist's) let SIGCHLD in and would take it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

#: A helper thread started before the main thread blocks SIGCHLD (as the supervisor's store
#: server is), then a child that exits while the main thread is not yet waiting: its SIGCHLD
#: must still be there for ``sigtimedwait``. Prints whether it was.
CHILD_END = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from relaunch.runtime import start_thread

    stop = threading.Event()
    helper = start_thread(stop.wait, "idle helper")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    child = os.posix_spawn(
        sys.executable, [sys.executable, "-c", "pass"], dict(os.environ), setsigmask=previous
    )
    deadline = time.monotonic() + 30
    while open(f"/proc/{child}/stat").read().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.01)
    info = signal.sigtimedwait({signal.SIGCHLD}, 5)
    os.waitpid(child, 0)
    stop.set()
    helper.join()
    print("heard" if info is not None and info.si_pid == child else "lost")
    """
)


def test_a_childs_end_reaches_the_main_thread_not_a_helper_thread() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", CHILD_END], capture_output=True, text=True, timeout=45
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["heard"]
