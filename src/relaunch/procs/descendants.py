"""Every descendant of a group's workers, wherever it went: found by a token in its environment.

A worker's process group holds what it starts, until a descendant leaves it: a daemon that
double-forks into a session of its own (fork, setsid, fork, the middle process exits) is in no
group of relaunch's and, orphaned, becomes a child of init. Linux keeps no ancestry that
survives that. What does survive is the environment: each group of workers gets a token,
added to ``RELAUNCH_TREE`` in every worker's environment, and every descendant inherits it
through fork and exec, whatever its session, group or parent. ``/proc/PID/environ`` shows it
(the environment as of the process's last exec: a zombie shows none).

The agent kills what carries the token when it closes the group (``kill_marked``); the orphan
guardian does the same with ``grep`` if the agent dies first, even by SIGKILL, when a child
subreaper could not help (the guardian is no ancestor of the workers; orphans go to init). A
subreaper in the agent would also make it reap whatever it adopts, in a process that may be the
user's own (``start_processes``) and whose other children it cannot tell apart.

What escapes: a descendant that replaces its environment when it execs (``env -i``) or that
its user's processes cannot read (setuid), and, for function workers, a descendant that never
execs (the function worker itself shows the agent's environment: multiprocessing does not exec
with the worker's). A process group or a cgroup covers those; /sys/fs/cgroup is seldom
writable where jobs run.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Collection, Mapping

#: The variable that holds the tokens of the groups a process descends from, separated by
#: spaces (a job run inside a worker of another keeps the outer job's token too).
TREE_ENV = "RELAUNCH_TREE"


def new_token() -> str:
    """A token no other group on this machine has: only letters, digits and dashes."""
    # os.urandom, not secrets: secrets loads OpenSSL (hashlib), 4 MiB of the launcher's memory
    return f"relaunch-tree-{os.getpid()}-{os.urandom(8).hex()}"


def with_token(env: Mapping[str, str], token: str) -> dict[str, str]:
    """``env`` with ``token`` added to ``RELAUNCH_TREE`` (after any that the worker's environment
    or the agent's already carries)."""
    inherited = env.get(TREE_ENV, os.environ.get(TREE_ENV, ""))
    return {**env, TREE_ENV: f"{inherited} {token}".strip()}


def marked(token: str, skip: Collection[int] = ()) -> list[int]:
    """The live processes, other than this one and ``skip``, whose environment carries
    ``token``. Processes that this user may not read are not seen."""
    needle = token.encode()
    prefix = f"{TREE_ENV}=".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == me or pid in skip:
            continue
        try:
            environ = _read(f"/proc/{entry}/environ")
        except OSError:
            continue
        if needle not in environ:  # most processes: one search of the whole block
            continue
        for variable in environ.split(b"\0"):
            if variable.startswith(prefix) and needle in variable[len(prefix) :].split():
                found.append(pid)
                break
    return found


def _read(path: str) -> bytes:
    """The whole of a /proc file, through the descriptor alone: a scan reads one per process at
    every group's end, and a Python file object costs twice the time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def kill_marked(token: str, timeout: float, skip: Collection[int] = ()) -> list[int]:
    """SIGKILL every process that carries ``token`` and wait for it to die, again until none is
    left (what they forked meanwhile carries it too), for at most ``timeout`` seconds.
    Returns those still alive then (stuck in the kernel); ``skip`` are left alone."""
    deadline = time.monotonic() + timeout
    while True:
        pids = marked(token, skip)
        if not pids:
            return []
        fds = []
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except (AttributeError, OSError):
                pass  # gone already, or no pidfds: the next scan tells
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            pending = set(fds)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ready, _, _ = select.select(pending, [], [], left)
                pending.difference_update(ready)
        finally:
            for fd in fds:
                os.close(fd)
        if time.monotonic() >= deadline:
            return marked(token, skip)
        if not fds:  # nothing to wait on: do not spin
            time.sleep(0.01)
