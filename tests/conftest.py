"""Fixtures shared by all tests: conditions with deadlines, and proof that no process leaks.

The leak detector lives in tests/support/procs.py (shared with the chaos harness and the
benchmarks); its names are re-exported here for the tests that import them from conftest."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from etcd_cluster import EtcdCluster

from tests.support import tmpdir
from tests.support.procs import MARK_VAR, LeakCheck, LinesRead, marked_pids, pid_alive

__all__ = [
    "MARK_VAR",
    "LeakCheck",
    "LinesRead",
    "background_ignores_undone",
    "marked_pids",
    "pid_alive",
    "relaunch_cli",
    "said_until",
    "signal_handlers_kept",
    "tmpfs",
    "wait_until",
]


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes config._tmp_path_factory
def pytest_configure(config: pytest.Config) -> None:
    """``TMPDIR`` under pytest's basetemp for the whole session, this process and every process
    a test starts: launcher output (log directories, ...) goes there, none to ``/tmp``. The
    signals a background job starts with ignored are put back at their defaults."""
    tmpdir.use(config._tmp_path_factory.getbasetemp())  # each xdist worker: its own basetemp
    background_ignores_undone()


#: What a shell without job control ignores in a job it starts in the background (``make test
#: &`` in a script), and Python's own disposition of each.
_BACKGROUND_IGNORED = {signal.SIGINT: signal.default_int_handler, signal.SIGQUIT: signal.SIG_DFL}


def background_ignores_undone() -> None:
    """Give SIGINT and SIGQUIT back their defaults where this process inherited them ignored.

    Every process a test starts inherits an ignored signal, and tests send these two (Ctrl-C to
    ``relaunch status --watch``, SIGINT and SIGQUIT to a launcher) expecting what a terminal
    gives: ignored, the process never ends, and its test times out. Done in every pytest
    process (xdist's workers too) before any test runs."""
    for sig, default in _BACKGROUND_IGNORED.items():
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, default)


def pytest_unconfigure(config: pytest.Config) -> None:
    tmpdir.restore()


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Wait for ``condition()`` to be true, checking often, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def said_until(proc: subprocess.Popen[str], text: str) -> str:
    """What ``proc`` wrote to its stderr (a pipe) up to the line holding ``text``, the rest
    left to read; fails if it ended before. The test's timeout bounds the wait."""
    assert proc.stderr is not None
    said = ""
    while text not in said:
        line = proc.stderr.readline()
        if not line:
            pytest.fail(f"it ended before it said {text!r}:\n{said}")
        said += line
    return said


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


#: The signals an agent run in this process handles (and torch's ``start_processes``): each test
#: leaves their handlers as it found them, so no later test runs with another's.
_HANDLED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """The handlers of ``_HANDLED_SIGNALS`` put back as found: for a module fixture that runs an
    agent or torch's launcher in this process (set up before the test's own check)."""
    found = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in found.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _signal_handlers_kept() -> Iterator[None]:
    with signal_handlers_kept():
        yield


@pytest.fixture
def leaks() -> Iterator[LeakCheck]:
    """Fails the test if any process started with ``leaks.env`` is still alive 5 s after it."""
    check = LeakCheck()
    yield check
    left = check.collect(5.0, keep=_helpers_of_this_process())
    assert not left, "processes left behind (killed): " + "; ".join(left)


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


def relaunch_cli(
    leaks: LeakCheck, *argv: str, cwd: str | None = None, timeout: float = 50
) -> subprocess.CompletedProcess[str]:
    """``relaunch ARGV`` run to its end, its output captured as text, with ``leaks``' mark."""
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        cwd=cwd,
        timeout=timeout,
    )


@contextlib.contextmanager
def tmpfs(path: str, options: str) -> Iterator[str]:
    """A tmpfs mounted at ``path`` (made if missing) with ``options`` (``size=64k``, ...),
    unmounted after; skips the test where none can be mounted (not root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True, timeout=10)
