"""A process the zygote of ``--preload`` forked, as the agent holds it: the zygote's reply that
names it, checked where it enters, and its handle (``ZygoteHandle``).

Nothing from the zygote's socket is trusted: a worker forked from the zygote can take the
zygote's end of it (``pidfd_getfd``, the same uid) and write anything there. A reply
(``read_reply``) is fixed-size, carries the number of the request it answers and the pid, with
the read end of the child's status pipe and its pidfd; ``check_reply`` takes it only when the
number is the request's, the descriptors are what they claim to be, and the pid is a child of
the zygote that no handle holds yet (the zygote does not reap it before the agent says it
checked it, so it is there to be checked). Anything else is ``BadReply``: the zygote is lost.

A worker's exit is seen from its own pidfd, not through the zygote: a stopped or slow zygote
cannot delay it. Its wait status still comes from the zygote, its parent, which reaps it; one
that does not come within ``STATUS_TIMEOUT`` of the end is the kernel's, read from the zombie the
zygote left (``/proc/PID/stat``), or, where that cannot be read, unknown: the worker reads as
killed (-SIGKILL). A zygote late so that is lost when it is stopped (SIGSTOP, a tracer) or its
status cannot be read; one merely slow on a loaded machine keeps its workers.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import time
from collections.abc import Callable

from relaunch.core.run.failures import describe_exit
from relaunch.procs.handles import PopenHandle
from relaunch.procs.zygote_wire import INT_SIZE, REPLY_SIZE, SEQ_SIZE, received_fds

#: Seconds a zygote has, once its child ended, to give the child's exit status (it reaps on
#: SIGCHLD, in well under a millisecond): past it, the status is the kernel's, and a stopped
#: zygote is lost.
STATUS_TIMEOUT = 1.0
#: The descriptors a reply may carry: the status pipe, and the pidfd where there are pidfds.
MAX_REPLY_FDS = 2


class BadReply(Exception):
    """What the zygote's socket gave is no reply to the request (the message says why)."""


def has_pidfds() -> bool:
    """Whether this kernel gives pidfds (then every reply must carry one)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def read_reply(sock: socket.socket, deadline: float) -> tuple[int, int, list[int]] | None:
    """The next reply on ``sock`` (the request's number, the pid, the descriptors), or None at
    the end of the stream. ``TimeoutError`` past ``deadline`` (``time.monotonic()``);
    ``BadReply`` for descriptors the reply cannot hold (those that came are closed)."""
    data = b""
    fds: list[int] = []
    space = socket.CMSG_SPACE((MAX_REPLY_FDS + 1) * INT_SIZE)
    try:
        while len(data) < REPLY_SIZE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk, ancillary, flags, _ = sock.recvmsg(
                REPLY_SIZE - len(data), space, socket.MSG_CMSG_CLOEXEC
            )
            fds.extend(received_fds(ancillary))
            if flags & socket.MSG_CTRUNC or len(fds) > MAX_REPLY_FDS:
                raise BadReply("it came with more descriptors than a reply has")
            if not chunk:
                if data or fds:
                    raise BadReply("the stream ended inside it")
                return None
            data += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.settimeout(None)
    seq = int.from_bytes(data[:SEQ_SIZE], "little")
    return seq, int.from_bytes(data[SEQ_SIZE:], "little"), fds


def check_reply(
    reply: tuple[int, int, list[int]], seq: int, zygote: int, pidfds: bool
) -> tuple[int, int, int | None]:
    """The pid, status pipe and pidfd (None without pidfds) of ``reply``, the answer to request
    ``seq`` of the zygote ``zygote``; ``BadReply`` if it is no such answer (its descriptors are
    then closed). The caller still checks that no handle holds the pid already."""
    got, pid, fds = reply
    try:
        if got != seq:
            raise BadReply(f"it answers request {got}, not request {seq}")
        if len(fds) != 1 + pidfds:
            raise BadReply(f"it came with {len(fds)} descriptor(s), not {1 + pidfds}")
        if not _pipe_read_end(fds[0]):
            raise BadReply("its status descriptor is no pipe's read end")
        pidfd = fds[1] if pidfds else None
        if pidfd is not None and pidfd_pid(pidfd) != pid:
            raise BadReply(f"its pidfd is not one of pid {pid}")
        if parent_of(pid) != zygote or (pidfd is not None and not _alive_or_zombie(pidfd)):
            raise BadReply(f"it names pid {pid}, which is not a child of the zygote (pid {zygote})")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return pid, fds[0], pidfd


def _pipe_read_end(fd: int) -> bool:
    import fcntl  # small: only with --preload

    try:
        is_fifo = stat.S_ISFIFO(os.fstat(fd).st_mode)
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
        return False
    return is_fifo and mode == os.O_RDONLY


def pidfd_pid(fd: int) -> int | None:
    """The pid the pidfd ``fd`` refers to (-1 once reaped); None if ``fd`` is no pidfd."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as file:
            for line in file:
                if line.startswith("Pid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (a zombie's too); None when there is no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
        return int(data[data.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a tracer) or gone: it gives no status."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
        return data[data.rindex(b")") + 2 :].split()[0] in (b"T", b"t", b"Z", b"X")
    except (OSError, ValueError, IndexError):
        return True


def _alive_or_zombie(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` is not reaped yet (so its pid, read just before, was
    its own)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` becomes readable within ``timeout`` seconds (any descriptor number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000 + 0.999))))


class ZygoteHandle(PopenHandle):
    """A process forked by the zygote, as a ``PopenHandle`` is a cold one (a subclass for the
    monitor's types: no ``Popen`` behind it).

    ``exit_fd`` is its pidfd: readable once it ended, whatever the zygote does. ``status_fd``
    is the status pipe: readable once the zygote wrote the wait status, or at its end without
    one when the zygote died (the worker then reads as killed, -SIGKILL). Without pidfds
    ``exit_fd`` is the status pipe, and the zygote's end of it tells that its pid is gone.
    ``lost(why)`` is told when the zygote failed to give the status in time.
    """

    def __init__(
        self, pid: int, status_fd: int, pidfd: int | None, lost: Callable[[str], None]
    ) -> None:
        self.pid = pid
        self.status_fd = self._status_fd = status_fd
        self.exit_fd = status_fd if pidfd is None else pidfd
        os.set_blocking(status_fd, False)
        self._pidfd = pidfd
        self._lost = lost
        self._code: int | None = None
        self._orphaned = False
        #: When its pidfd said it ended (``time.monotonic()``; None: not yet).
        self._ended_at: float | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        if self._pidfd is not None and self._ended_at is None:
            if not _readable(self._pidfd, 0):
                return None
            self._ended_at = time.monotonic()
        if not self._orphaned:
            self._code = self._read_status()
        if self._code is None and self._orphaned and self._gone():
            self._code = -signal.SIGKILL
        late = self._ended_at is not None and time.monotonic() - self._ended_at >= STATUS_TIMEOUT
        if self._code is None and late:
            code = self._zombie_status()
            self._code = -signal.SIGKILL if code is None else code
            if code is not None and not _stopped(parent_of(self.pid)):
                return self._code  # a zygote slow on a loaded machine, not a lost one
            said = "its status unknown: it reads as killed" if code is None else "read from /proc"
            self._lost(
                f"did not give the exit status of pid {self.pid} within {STATUS_TIMEOUT:g}s of "
                f"its end ({describe_exit(self._code)}, {said})"
            )
        return self._code

    def _zombie_status(self) -> int | None:
        """Its exit code as the kernel keeps it while it is a zombie (``exit_code`` of
        ``/proc/PID/stat``, shown to its user or root only, 0 to others); None when it cannot
        be read so."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as file:
                uid = os.fstat(file.fileno()).st_uid
                data = file.read()
            fields = data[data.rindex(b")") + 2 :].split()
            if fields[0] != b"Z" or os.geteuid() not in (0, uid):
                return None
            status = int(fields[49])  # field 52, counted from 1 with the pid and the name
            if self._pidfd is None or not _alive_or_zombie(self._pidfd):
                return None  # not this process's any more
            return os.waitstatus_to_exitcode(status)
        except (OSError, ValueError, IndexError):
            return None

    def _read_status(self) -> int | None:
        """The exit code the zygote wrote, None while there is none (``_orphaned``: none will
        come). What is no wait status makes the zygote lost."""
        try:
            data = os.read(self._status_fd, INT_SIZE + 1)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            self._orphaned = True  # the zygote died before it could say
            return None
        status = int.from_bytes(data, "little")
        try:
            if len(data) != INT_SIZE:
                raise ValueError
            return os.waitstatus_to_exitcode(status)
        except ValueError:
            self._orphaned = True
            self._lost(f"gave {data!r} as the exit status of pid {self.pid}, which is none")
            return -signal.SIGKILL

    def _gone(self) -> bool:
        if self._pidfd is not None:
            return _readable(self._pidfd, 0)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def wait(self, timeout: float) -> int | None:
        """The exit code, waiting up to ``timeout`` seconds; None if it has not exited."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if self._ended_at is not None:  # its status, until the zygote's time is up
                left = min(left, self._ended_at + STATUS_TIMEOUT - time.monotonic())
                _readable(self._status_fd, max(left, 0.001))
            elif self._pidfd is not None:
                _readable(self._pidfd, left)
            elif not self._orphaned:
                _readable(self.exit_fd, left)
            else:  # no pidfds here: look again shortly
                time.sleep(min(left, 0.01))
        return self._code

    def kill(self) -> None:
        """SIGKILL it, unless it is known to have exited (through its pidfd where there is one:
        its pid may be another process's once the zygote reaped it)."""
        if self.poll() is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def holds_pid(self) -> bool:
        """Whether its pid is still its own (it has not been reaped): no new child has it."""
        if self._pidfd is None:
            return self._code is None
        try:
            return _alive_or_zombie(self._pidfd)
        except OSError:  # released
            return False

    def abandon(self) -> None:
        """Nothing to do: the zygote reaps it whenever it dies."""

    def release(self) -> None:
        os.close(self._status_fd)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
