"""JSON-lines files that several processes append to: the event and metric logs.

Each line goes out in one ``write(2)`` on an ``O_APPEND`` descriptor, so lines from concurrent
writers never interleave; a file is rotated past a size, never followed through a symbolic link,
and a line that cannot be written never fails the job. ``check_log_file`` says, before a run,
why a path cannot be such a file.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

from relaunch.core.defaults import MAX_LOG_BYTES as MAX_LOG_BYTES

log = logging.getLogger(__name__)


class JsonLinesWriter:
    """Appends whole lines to a file, each with one ``write(2)`` on an O_APPEND descriptor.

    One write per line means lines from concurrent processes appending to the same file never
    interleave, and a reader following the file (``tail -F``) sees each line as soon as it is
    recorded. The file is opened on the first line (so an unused handler creates nothing) and
    again after ``close`` if more lines come. Past ``max_bytes`` it is rotated to ``PATH.1``;
    of several writers sharing it, the one that finds the file still its own renames it, and
    the others follow to the new one.

    The file is opened with ``O_NOFOLLOW``: a symbolic link planted at ``PATH`` (say, to a file
    of the user's in a shared directory) is refused, never appended to. A line that cannot be
    written (a full disk, an I/O error, the file gone) never raises: the first failure is said
    once, naming the file and the cause, later lines are tried again, and the recovery is said
    with the number of lines lost.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_LOG_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._lost = 0  # lines not written since the last failure was said
        self._torn = False  # a line was cut short by a failure: the next one starts afresh

    def _open(self) -> int:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        flags = (
            os.O_WRONLY
            | os.O_APPEND
            | os.O_CREAT
            | os.O_NOFOLLOW
            | os.O_NONBLOCK  # a FIFO planted at PATH must not block the open
            | getattr(os, "O_CLOEXEC", 0)
        )
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(exc.errno, _SYMLINK_REFUSED) from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
                raise OSError(errno.EINVAL, "not a regular file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _rotate(self, fd: int) -> None:
        """Rename the file to ``PATH.1`` if it is still the one ``fd`` writes, and let go of
        ``fd``. (``rename`` moves a name, never what a link at ``PATH.1`` points to.)"""
        try:
            mine = os.fstat(fd)
            try:
                named = os.lstat(self.path)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_ino, named.st_dev) == (mine.st_ino, mine.st_dev):
                os.replace(self.path, self.path + ".1")
        finally:
            os.close(fd)

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        with self._lock:
            try:
                self._write(data)
            except OSError as exc:
                self._failed(exc)
            else:
                if self._lost:
                    log.warning(
                        "%s: writing again (%d line%s lost)",
                        self.path,
                        self._lost,
                        "" if self._lost == 1 else "s",
                    )
                    self._lost = 0

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            self._fd = self._open()
        size = os.fstat(self._fd).st_size
        if size and size + len(data) > self.max_bytes:
            fd, self._fd = self._fd, None
            self._rotate(fd)
            self._fd = self._open()
        if self._torn:
            data = b"\n" + data  # the cut line stays a line of its own, never glued to this
        view = memoryview(data)
        while view:  # a short write only happens on a full disk or a signal
            try:
                written = os.write(self._fd, view)
            except OSError:
                self._torn = self._torn or len(view) < len(data)
                raise
            view = view[written:]
            self._torn = bool(view)
        self._torn = False

    def _failed(self, exc: OSError) -> None:
        if not self._lost:
            log.warning(
                "cannot write %s (%s): its lines are dropped until it can be written again; "
                "the job goes on",
                self.path,
                exc.strerror or exc,
            )
        self._lost += 1
        if self._fd is not None and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            # An I/O error, or the file replaced under us: reopen it for the next line.
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.close(fd)
                except OSError:  # a deferred write error (NFS): said as any other
                    pass


_SYMLINK_REFUSED = (
    "it is a symbolic link, which relaunch does not follow (it would append to whatever the "
    "link points at): remove it or name the file itself"
)


def check_log_file(path: str, what: str = "event log") -> None:
    """Whether ``path`` can be the file of a JSON-lines handler: ValueError in one line saying
    what is wrong and what to do when it cannot (a directory, a symbolic link, something other
    than a file, a file that cannot be written, a place where none can be created). Creates
    nothing."""
    try:
        info: os.stat_result | None = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        info = None  # creatable() says why not, if it cannot be created
    except OSError as exc:
        raise ValueError(f"{what} {path}: {_why(exc, path)}") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise ValueError(f"{what} {path}: {_SYMLINK_REFUSED}")
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(
                f"{what} {path} is a directory: name a file, e.g. "
                f"{os.path.join(path, 'events.jsonl')}"
            )
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISCHR(info.st_mode)):
            raise ValueError(f"{what} {path} is not a regular file: name a file")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC))
        except OSError as exc:
            raise ValueError(
                f"{what} {path} cannot be written ({_why(exc, path)}): name a file you can write"
            ) from None
        return
    problem = creatable(os.path.dirname(os.path.abspath(path)))
    if problem:
        raise ValueError(f"{what} {path} cannot be created: {problem}")


def creatable(directory: str) -> str:
    """Why ``directory`` (or a file in it) cannot be created by this process, or "" when it can:
    the nearest existing ancestor must be a directory in which this process can make one
    (``unwritable``), and no ancestor a symbolic link to nothing."""
    ancestor = os.path.abspath(directory)
    while True:
        try:
            info = os.stat(ancestor)
            break
        except FileNotFoundError:
            if os.path.islink(ancestor):  # os.makedirs would meet the link: "File exists"
                return (
                    f"{ancestor} is a symbolic link to {os.readlink(ancestor)}, which does not "
                    "exist: make what it points to, or remove the link"
                )
            parent = os.path.dirname(ancestor)
            if parent == ancestor:
                return f"{ancestor} does not exist"
            ancestor = parent
        except OSError as exc:
            return f"{ancestor}: {_why(exc, ancestor)}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{ancestor} is not a directory"
    return unwritable(ancestor)


def unwritable(directory: str) -> str:
    """Why this process cannot make anything in the existing ``directory``, or "" when it can.

    It tries: makes a directory of a name of its own there, and removes it. ``os.access``
    cannot tell: it says yes to root on ``/sys`` and on a server that squashes root, and says
    nothing of quotas and full inode tables."""
    probe = os.path.join(directory, f".relaunch-check-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(probe, 0o700)
    except OSError as exc:
        return f"{directory} is not writable by this user ({exc.strerror or exc})"
    try:
        os.rmdir(probe)
    except OSError:
        log.debug("cannot remove %s", probe, exc_info=True)
    return ""


def _why(exc: OSError, path: str) -> str:
    if exc.errno == errno.ELOOP:
        return _SYMLINK_REFUSED
    return exc.strerror or str(exc)
