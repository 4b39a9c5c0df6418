"""A launcher process for tests that signal or kill it: python launcher.py LOG_DIR PID_DIR KIND.

It starts two workers (``KIND`` is ``binary`` or ``function``), each with a grandchild, prints
``ready`` once every pid is on disk, and waits. On SIGTERM/SIGINT/SIGHUP/SIGQUIT it stops the
workers and exits with 128 + signal, the way the seeds' callers are meant to.
"""

from __future__ import annotations

import os
import sys
import time

import procfns

from relaunch import SignalException, start_processes

GRANDCHILD = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '300'])\n"
    "open(os.path.join(sys.argv[1], f'{os.getpid()}.{child.pid}'), 'w').close()\n"
    "time.sleep(300)\n"
)


def main() -> int:
    log_dir, pid_dir, kind = sys.argv[1:4]
    envs = {rank: {"LOCAL_RANK": str(rank)} for rank in range(2)}
    if kind == "binary":
        args = dict.fromkeys(range(2), ("-c", GRANDCHILD, pid_dir))
        pc = start_processes("w", sys.executable, args, envs, log_dir)
    else:
        pc = start_processes(
            "w",
            procfns.start_grandchild_and_sleep,
            dict.fromkeys(range(2), (pid_dir,)),
            envs,
            log_dir,
        )  #
    try:
        while len(os.listdir(pid_dir)) < 2:
            time.sleep(0.005)
        print("ready", flush=True)
        pc.wait()
    except SignalException as exc:
        pc.close(exc.sigval, timeout=5)
        return 128 + int(exc.sigval)
    pc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
