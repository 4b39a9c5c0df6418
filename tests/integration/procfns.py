"""Function entrypoints for the integration tests (importable by spawned children)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def echo_rank(value: str) -> str:
    return f"{value}:{os.environ['LOCAL_RANK']}:{os.environ['RELAUNCH_TEST_MARK'][:4]}"


def fail_on_rank(bad_rank: int) -> int:
    rank = int(os.environ["LOCAL_RANK"])
    if rank == bad_rank:
        raise ValueError(f"rank {rank} cannot go on")
    time.sleep(300)
    return rank


def print_lines(count: int) -> None:
    for index in range(count):
        print(f"line {index} of rank {os.environ['LOCAL_RANK']}")
    print("to stderr", file=sys.stderr)


def return_unpicklable() -> object:
    return lambda: None


def start_grandchild_and_sleep(pid_dir: str) -> None:
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(pid_dir, f"{os.getpid()}.{child.pid}"), "w"):
        pass
    time.sleep(300)


def exit_with(code: int) -> None:
    sys.exit(code)


def kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
