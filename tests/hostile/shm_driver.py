"""Run by tests/hostile/test_shm_names.py as root in a mount namespace of its own, with a fresh
tmpfs on /dev/shm (no other job's names are seen or touched): ``shm_driver.py MODE OUT``.
Prints one JSON line of what it saw.

- ``squat``: a squatter of another user (``nobody``) creates, as soon as a channel appears in
  /dev/shm, the names beside it that relaunch used to make (``.wake``, ``.pending0``, ``.park``)
  and a FIFO at ``.bounds0``, and tries the same inside it; five jobs of two ranks run, each
  restarting once. Says each job's exit status (``hung`` past its deadline) and how many names
  the squatter made.
- ``killed``: a job keeping state (``--state-memory``) is killed whole at once, its agent, the
  agent's guardian and its workers (SIGSTOP to each, then SIGKILL to each, as a cgroup kill);
  then another job runs. Says what /dev/shm held after the kill and after the second job.
"""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import signal
import subprocess
import sys
import time
import uuid

RELAUNCH = [sys.executable, "-m", "relaunch"]
SHM = "/dev/shm"
JOB_MARK = "SHM_DRIVER_JOB"
#: The names the squatter makes beside (and in) a channel, and whether each is a FIFO.
SQUATTED = ((".wake", True), (".pending0", True), (".park", False), (".bounds0", True))

#: argv: OUT. Local rank 0 fails in the first attempt; every other run exits 0.
RESTARTING = (
    "import os, sys\n"
    "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['LOCAL_RANK'] == '0':\n"
    "    sys.exit(1)\n"
)
#: argv: OUT. Says it started (OUT/started.LOCAL_RANK), then waits to be killed.
WAITING = (
    "import os, pathlib, sys, time\n"
    "out = pathlib.Path(sys.argv[1])\n"
    "(out / ('started.' + os.environ['LOCAL_RANK'])).write_text('')\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def names() -> list[str]:
    return sorted(os.listdir(SHM))


def squatter() -> int:
    """Fork a process of ``nobody`` that squats every channel's names until it is killed."""
    nobody = pwd.getpwnam("nobody")
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
        done: set[str] = set()
        while True:
            for entry in os.scandir(SHM):
                if not entry.name.startswith("relaunch_channel_") or "." in entry.name:
                    continue
                inside = os.path.join(entry.path, "channel")
                for base in (entry.path, inside):
                    for suffix, fifo in SQUATTED:
                        path = base + suffix
                        if path in done:
                            continue
                        done.add(path)
                        try:
                            if fifo:
                                os.mkfifo(path, 0o666)
                            else:
                                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
                            with open("/dev/shm/squatted", "a") as count:
                                count.write(path + "\n")
                        except OSError:
                            pass
            time.sleep(0.0005)
    finally:
        os._exit(0)


def job_pids(mark: str) -> list[int]:
    """The live processes of the job marked ``mark`` (its environment carries it)."""
    needle = f"{JOB_MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                if needle in file.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def squat(out: pathlib.Path) -> dict[str, object]:
    worker = out / "restarting.py"
    worker.write_text(RESTARTING)
    pid = squatter()
    runs: list[object] = []
    try:
        for _ in range(5):
            try:
                done = subprocess.run(
                    [*RELAUNCH, "--nproc-per-node", "2", "--max-restarts", "1", str(worker)],
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                runs.append(done.returncode)
                if done.returncode:
                    runs.append(done.stderr[-600:])
            except subprocess.TimeoutExpired:  # the agent was killed: its guardian ends the rest
                runs.append("hung")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        squatted = len(pathlib.Path(SHM, "squatted").read_text().splitlines())
    except OSError:
        squatted = 0
    return {"runs": runs, "squatted": squatted}


def killed(out: pathlib.Path) -> dict[str, object]:
    worker = out / "waiting.py"
    worker.write_text(WAITING)
    mark = uuid.uuid4().hex
    job = subprocess.Popen(
        [*RELAUNCH, "--nproc-per-node", "2", "--state-memory", "64M", str(worker), str(out)],
        env={**os.environ, JOB_MARK: mark},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not all((out / f"started.{rank}").exists() for rank in range(2)):
        if time.monotonic() > deadline or job.poll() is not None:
            job.kill()
            return {"error": "the job did not start"}
        time.sleep(0.01)
    running = names()
    pids = job_pids(mark)
    for pid in pids:  # nothing of the job runs on while the others die: a cgroup kill
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    job.wait(10)
    deadline = time.monotonic() + 10
    while job_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = names()
    (out / "ok.py").write_text("")
    done = subprocess.run(
        [*RELAUNCH, "--nproc-per-node", "1", str(out / "ok.py")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return {
        "running": running,
        "killed": len(pids),
        "left": left,
        "second": done.returncode,
        "after": names(),
    }


def main() -> None:
    mode, out = sys.argv[1], pathlib.Path(sys.argv[2])
    result = squat(out) if mode == "squat" else killed(out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
