"""Fixtures shared by all tests: conditions with deadlines, and proof that no process leaks."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from etcd_cluster import EtcdCluster

MARK_VAR = "RELAUNCH_TEST_MARK"


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Wait for ``condition()`` to be true, checking often, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _helpers_of_this_process() -> set[int]:
    """Long-lived helpers this test process keeps for all tests: they are not leaks."""
    from multiprocessing import forkserver, resource_tracker

    from relaunch.procs import guardian

    pids = {os.getpid()}
    if guardian._guardian is not None:
        pids.add(guardian._guardian.pid)
    tracker_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    server_pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    pids.update(pid for pid in (tracker_pid, server_pid) if pid)
    return pids


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment carries ``RELAUNCH_TEST_MARK=mark``."""
    needle = f"{MARK_VAR}={mark}".encode()
    found = []
    helpers = _helpers_of_this_process()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in helpers:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                environ = file.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return found


class LeakCheck:
    """A mark to put in the environment of everything a test starts; checked after the test."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex

    @property
    def env(self) -> dict[str, str]:
        return {MARK_VAR: self.mark}

    def envs(self, nprocs: int, **extra: str) -> dict[int, dict[str, str]]:
        """One environment per local rank: the mark, ``LOCAL_RANK`` and ``extra``."""
        return {rank: {**self.env, "LOCAL_RANK": str(rank), **extra} for rank in range(nprocs)}

    def process_env(self, **extra: str) -> dict[str, str]:
        """A full environment for a process the test starts itself (e.g. the relaunch CLI)."""
        return {**os.environ, **self.env, **extra}


@pytest.fixture
def leaks() -> Iterator[LeakCheck]:
    """Fails the test if any process started with ``leaks.env`` is still alive 5 s after it."""
    check = LeakCheck()
    yield check
    deadline = time.monotonic() + 5.0
    left = marked_pids(check.mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = marked_pids(check.mark)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def log_dir(tmp_path: os.PathLike[str]) -> str:
    path = os.path.join(tmp_path, "logs")
    os.mkdir(path)
    return path


def _etcd_cluster(size: int) -> EtcdCluster:
    """A started cluster; fails (never skips) without etcd, since CI must prove etcd works."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not on PATH: run `make test`, which installs Debian's etcd-server")
    return EtcdCluster(size).start()


@pytest.fixture
def etcd() -> Iterator[EtcdCluster]:
    """A fresh single-member etcd on free loopback ports, stopped after the test."""
    with _etcd_cluster(1) as cluster:
        yield cluster


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on free loopback ports, stopped after the test."""
    with _etcd_cluster(3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def etcd_shared() -> Iterator[EtcdCluster]:
    """One single-member etcd for the whole session: use keys no other test uses."""
    with _etcd_cluster(1) as cluster:
        yield cluster
