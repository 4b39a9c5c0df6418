"""The agent's private directories in shared memory (``/dev/shm``): the workers' channel and
kept state.

Each is made by ``mkdtemp`` (mode 0700: no name in it can be taken, planted or read by another
user) and holds a lock file that its agent keeps ``flock``-ed for its life. The guardian
removes a directory when its agent dies alone; when the job's whole process tree is killed at
once (a cgroup kill, as Kubernetes and Slurm do), the guardian dies with it, and the next agent
of the same user on the host removes the directories whose lock nobody holds (``reclaim``). A
flock ends with the last descriptor of its holder, however that died, and knows no pids to be
reused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile

from relaunch.procs.guardian import guardian

log = logging.getLogger(__name__)

#: The names of the directories relaunch makes in shared memory, by what they hold.
CHANNEL_PREFIX = "relaunch_channel_"
STATE_PREFIX = "relaunch_state_"
#: The lock file in each; a directory without one (being made, or not relaunch's) is left alone.
LOCK = "lock"


def shared_memory() -> str | None:
    """Where the directories go: ``/dev/shm``, or the temporary directory where there is none."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class PrivateDirectory:
    """A directory ``prefix``-named in shared memory, mode 0700, removed by ``close``, by the
    guardian if this process dies alone, or by the next agent on the host if all die at once."""

    def __init__(self, prefix: str) -> None:
        where = shared_memory()
        reclaim(where or tempfile.gettempdir())
        self.path = tempfile.mkdtemp(prefix=prefix, dir=where)
        guardian().register_file(self.path)
        try:
            # Locked under another name, then renamed: a lock file found is a held one.
            making = os.path.join(self.path, LOCK + ".new")
            self._lock = os.open(
                making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            os.rename(making, os.path.join(self.path, LOCK))
        except BaseException:
            self._remove()
            raise

    def close(self) -> None:
        """Remove the directory and what is in it, then let go of its lock."""
        self._remove()
        os.close(self._lock)

    def _remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        guardian().unregister_file(self.path)


def reclaim(where: str) -> list[str]:
    """Remove the directories of this user's relaunch in ``where`` that no live agent holds
    (their lock is free): what a job killed whole left. The paths removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(where))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith((CHANNEL_PREFIX, STATE_PREFIX)):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            lock = os.open(
                os.path.join(entry.path, LOCK),
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
            )
        except OSError:  # no lock file: being made, or not ours
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its agent lives
            os.close(lock)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(lock)
        removed.append(entry.path)
    if removed:
        log.info("removed what killed jobs left in shared memory: %s", ", ".join(removed))
    return removed
