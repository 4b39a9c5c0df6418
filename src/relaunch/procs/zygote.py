"""Warm starts (``--preload``): Python workers forked from a zygote that imported the heavy
modules once, rather than started cold.

The agent keeps one ``Zygote`` for its run: started when the run begins (its imports overlap the
rendezvous), asked for each Python worker of every attempt (``spawn``, from
``SubprocessContext``), started again when it died, and closed when the run ends. The zygote is
``procs.zygote_program``, run by path in the workers' own interpreter; the two talk over a Unix
socket pair (``procs.zygote_wire``: marshal data, descriptors by ``SCM_RIGHTS``).

A worker forked from it sees what ``python [-u] script.py ARGS`` or ``python [-u] -m MODULE
ARGS`` started by ``subprocess.Popen`` would: the agent sends, with the request, everything a
fresh process takes from its parent at that moment (the environment, the working directory,
the calling thread's CPUs and signal mask, the ignored signals, the umask, its stdin, stdout and
stderr). What the zygote cannot reproduce exactly starts cold, as before (``spawn`` returns
None): another interpreter or interpreter options (``-c``, ``-O``, ``-X``...; ``-u`` only where
the zygote has it too), a ``sys.path[0]`` other than the zygote's, a difference in a variable
the interpreter reads as it starts (``PYTHON*``, the locale's), a directory or zip archive as
the script.

A ``ZygoteHandle`` (``procs.zygote_handle``) is what ``PopenHandle`` is for a cold worker: the
pid, its pidfd (readable when it ended), the status pipe, ``poll``, ``wait``, ``abandon`` and
``release``. If the zygote dies, its workers die with it (``PR_SET_PDEATHSIG``) and read as
killed (-SIGKILL); the group then restarts as after any failure, from a new zygote.

Nothing the zygote's socket gives is trusted (a worker can take the zygote's end of it): the
requests are numbered, and a reply that is not the answer to the request
(``zygote_handle.check_reply``), a report on the imports that is not one, or an exit status a
stopped zygote did not give in time (``zygote_handle.STATUS_TIMEOUT``) makes the zygote lost: it
is killed, said in one line, and the next start has a new one, as for a zygote that died.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from relaunch.procs.guardian import guardian
from relaunch.procs.signals import signals_deferred
from relaunch.procs.zygote_command import (
    PythonCommand,
    caller,
    python_command,
    runs_as_popen_would,
    startup_variables,
    worker_request,
)
from relaunch.procs.zygote_handle import (
    BadReply,
    ZygoteHandle,
    check_reply,
    has_pidfds,
    read_reply,
)
from relaunch.procs.zygote_wire import MAX_REPORT, receive_message, send_message

log = logging.getLogger(__name__)

#: The zygote's program (``zygote_program.py``), read and run by path (``argv[1]``) in
#: ``__main__``.
PROGRAM = os.path.join(os.path.dirname(__file__), "zygote_program.py")
BOOT = "import sys;p=sys.argv[1];exec(compile(open(p,'rb').read(),p,'exec'))"
#: Seconds a request waits for the zygote's reply (a fork, even of a large process, takes far
#: less): past it the zygote counts as gone, and a new one is started.
REPLY_TIMEOUT = 60.0


class PreloadError(Exception):
    """The modules ``--preload`` names cannot be preloaded (the message says why, in one
    line); the agent reports it as bad input."""


class ZygoteGone(Exception):
    """The zygote ended, its socket broke, or it gave what is no answer (it is let go of); the
    message says which."""


class Zygote:
    """The zygote of one agent: imports ``preload`` once, in the interpreter and with the
    options of ``command`` (the workers' command line), with the environment ``env`` (the
    launcher's and the variables every worker gets), then forks the workers (``spawn``).

    ``start`` starts it (and returns at once); ``spawn`` waits for it to be ready the first
    time, and starts it again when it died. ``close`` ends it. ``started`` counts the zygotes
    started; ``ready`` is the last one's report (its pid, the threads its imports left).
    """

    def __init__(
        self, preload: Sequence[str], command: PythonCommand, env: Mapping[str, str]
    ) -> None:
        self.preload = tuple(preload)
        self._command = command
        self._env = dict(env)
        self._startup = startup_variables(self._env)
        self._cwd = os.getcwd()
        self._path0 = command.path0(self._cwd)
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self.ready: dict[str, Any] | None = None
        self.started = 0
        self._cold_reason = ""
        self._closed = False
        self._pidfds = has_pidfds()
        #: The last request's number (each zygote numbers from 1).
        self._seq = 0
        #: The processes the running zygote forked, by pid, while the agent holds them.
        self._children: weakref.WeakValueDictionary[int, ZygoteHandle] = (
            weakref.WeakValueDictionary()
        )
        #: The zygote found lost (said in one line already; killed).
        self._lost: subprocess.Popen[bytes] | None = None
        _zygotes.add(self)

    @property
    def pid(self) -> int | None:
        """The running zygote's pid (None: none runs)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the zygote unless one runs (its imports run meanwhile)."""
        with self._lock:
            if self._proc is None and not self._cold_reason and not self._closed:
                self._launch()

    def revive(self) -> None:
        """Start a new zygote now if the last one died or was lost (it imports while the agent
        rejoins)."""
        with self._lock:
            if self._proc is not None and self._let_go_if_lost():
                self._launch()
            elif self._proc is not None and self._proc.poll() is not None:
                log.warning("--preload: %s; starting a new one", self._ended())
                self._launch()

    def _lose(self, proc: subprocess.Popen[bytes], why: str) -> None:
        """The zygote ``proc`` failed its side (``why``: what it did): one line, and SIGKILL;
        the next start has a new one. From any thread (a worker's monitor): takes no lock, as
        a request may hold it while it waits for this zygote."""
        if proc is not self._proc or proc is self._lost:
            return  # let go of already
        self._lost = proc
        log.warning(
            "--preload: the zygote (pid %d) %s; it is lost: killed, the next start has a new one",
            proc.pid,
            why,
        )
        proc.kill()

    def _let_go_if_lost(self) -> bool:
        """Let go of the running zygote if it was found lost (said already); whether it was."""
        proc = self._proc
        if proc is None or proc is not self._lost:
            return False
        self._discard()
        return True

    def _launch(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = self._command
        argv = [
            command.python,
            *command.options,
            "-c",
            BOOT,
            PROGRAM,
            str(child.fileno()),
            "preload=" + ",".join(self.preload),  # for ps: what this process is
        ]
        try:
            proc = subprocess.Popen(
                argv,
                env=self._env,
                cwd=self._cwd,
                stdin=subprocess.DEVNULL,
                pass_fds=(child.fileno(),),
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            parent.close()
            self._cold_reason = f"cannot start {command.python}: {exc}"
            log.warning("--preload: %s; the workers start cold", self._cold_reason)
            return
        finally:
            child.close()
        guardian().register(proc.pid)
        self._proc, self._sock, self.ready = proc, parent, None
        self._seq = 0
        self._children.clear()
        self.started += 1
        setup = {
            "preload": list(self.preload),
            "argv": command.sys_argv,
            "path0": self._path0,
            "agent": os.getpid(),
        }
        try:
            send_message(parent, setup)
        except OSError:
            pass  # it died already: found out when it is asked for a worker

    def _discard(self) -> None:
        """Let go of the zygote: close its socket and SIGKILL it (it has nothing to finish;
        workers it still has die with it)."""
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        self.ready = None
        if sock is not None:
            sock.close()
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        guardian().unregister(proc.pid)

    def close(self) -> None:
        """End the zygote (its workers, if any still run, die with it)."""
        with self._lock:
            self._closed = True
            self._discard()

    def _wait_ready(self) -> bool:
        """Wait for the zygote's report (the first time); whether workers may be forked from
        it. PreloadError when the modules cannot be imported."""
        if self.ready is not None:
            return True
        sock = self._sock
        assert sock is not None
        try:
            got = receive_message(sock, 0, MAX_REPORT)
        except (OSError, EOFError):
            got = None
        except (ValueError, TypeError) as bad:  # no message, or no marshal data
            self._discard()
            raise ZygoteGone(f"the zygote's report on its imports is not one ({bad})") from None
        except BaseException:
            self._discard()  # a signal: the next start begins from a new zygote
            raise
        if got is None:
            raise ZygoteGone(self._ended())
        report = got[0]
        for fd in got[1]:
            os.close(fd)
        if not _is_report(report):
            self._discard()
            raise ZygoteGone(f"the zygote's report on its imports is not one: {report!r:.200}")
        self.ready = report
        error = report["error"]
        if error is not None:
            self._discard()
            raise PreloadError(f"--preload {','.join(self.preload)}: {error}")
        why = ""
        if report["cuda"]:
            why = "importing them initialised CUDA, which a forked process cannot use"
        elif report["python_threads"]:
            names = ", ".join(report["python_threads"])
            why = f"importing them started Python threads ({names}) that forked workers would lack"
        if why:
            self._cold_reason = why
            log.warning("--preload %s: %s; the workers start cold", ",".join(self.preload), why)
            self._discard()
            return False
        if report["native_threads"]:
            log.warning(
                "--preload %s: importing them left %d native thread(s) running in the zygote; "
                "forked workers do not have them",
                ",".join(self.preload),
                report["native_threads"],
            )
        return True

    def _ended(self) -> str:
        """Why the zygote stopped answering (it is let go of)."""
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(1.0)  # its socket closed as it died: it is about to be reaped
            except subprocess.TimeoutExpired:
                pass
        self._discard()
        if code is None:
            return "the zygote stopped answering"
        if code < 0:
            try:
                return f"the zygote died of {signal.Signals(-code).name}"
            except ValueError:
                return f"the zygote died of signal {-code}"
        return f"the zygote exited with status {code}"

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], stdout: int | None, stderr: int | None
    ) -> ZygoteHandle | None:
        """Fork the worker ``argv`` with the environment ``env`` (all of it), writing to the
        descriptors ``stdout`` and ``stderr`` (None: the agent's); None when it must start
        cold (``python_command``, ``startup_variables``, a script that is no file)."""
        command = python_command(argv, (self._command.python,))
        if command is None or not self._fits(command, env):
            return None
        try:
            parent = caller()
        except OSError:
            return None
        if command.path0(parent.cwd) != self._path0:
            return None
        return self._ask(*worker_request(argv, command, env, stdout, stderr, parent))

    def _ask(self, request: dict[str, Any], fds: list[int]) -> ZygoteHandle | None:
        """Have the zygote fork for ``request``, waiting for it to be ready; None when the
        workers start cold (``_cold_reason``) or the zygote is closed."""
        with self._lock:
            for _ in range(2):  # a zygote found dead is started again, once
                if self._cold_reason or self._closed:
                    return None
                self._let_go_if_lost()
                if self._proc is None:
                    self._launch()
                    if self._proc is None:
                        return None
                lost = self._lost
                try:
                    if not self._wait_ready():
                        return None
                    return self._request(request, fds)
                except ZygoteGone as gone:
                    if self._lost is lost:  # else said as it was found lost
                        log.warning("--preload: %s; starting a new one", gone)
            raise PreloadError(
                f"--preload {','.join(self.preload)}: the zygote died twice in a row before it "
                "could fork a process"
            )

    def _fits(self, command: PythonCommand, env: Mapping[str, str]) -> bool:
        if (command.python, command.options) != (self._command.python, self._command.options):
            return False
        return startup_variables(env) == self._startup and runs_as_popen_would(command, env)

    def _request(self, request: dict[str, Any], fds: list[int]) -> ZygoteHandle:
        """Send ``request``, numbered, and take the reply that answers it, checked (the
        zygote then may reap the child); ``ZygoteGone`` if none does."""
        sock, proc = self._sock, self._proc
        assert sock is not None and proc is not None
        self._seq += 1
        try:
            with signals_deferred():  # a request and its reply, whole
                sock.settimeout(REPLY_TIMEOUT)
                try:
                    send_message(sock, {**request, "seq": self._seq}, fds)
                finally:
                    sock.settimeout(None)
                reply = read_reply(sock, time.monotonic() + REPLY_TIMEOUT)
                if reply is None:
                    raise EOFError
                pid, status_fd, pidfd = check_reply(reply, self._seq, proc.pid, self._pidfds)
                known = self._children.get(pid)
                if known is not None and known.holds_pid():
                    os.close(status_fd)
                    if pidfd is not None:
                        os.close(pidfd)
                    raise BadReply(f"it names pid {pid}, which the zygote forked before")
                handle = ZygoteHandle(pid, status_fd, pidfd, partial(self._lose, proc))
                self._children[pid] = handle
                try:
                    send_message(sock, {"checked": pid})
                except OSError:
                    pass  # it died since: so does the child, which reads as killed
        except BadReply as bad:
            self._discard()
            why = f"the zygote's reply is no answer to request {self._seq}: {bad}"
            raise ZygoteGone(why) from None
        except (OSError, EOFError):
            raise ZygoteGone(self._ended()) from None
        except BaseException:
            self._discard()
            raise
        return handle


def _is_report(report: object) -> bool:
    """Whether ``report`` is the zygote's report on its imports (``zygote_program.main``)."""
    if not isinstance(report, dict) or set(report) != {
        "error",
        "pid",
        "python_threads",
        "native_threads",
        "cuda",
    }:
        return False
    threads = report["python_threads"]
    return (
        isinstance(report["error"], (str, type(None)))
        and type(report["pid"]) is int
        and isinstance(threads, list)
        and all(isinstance(name, str) for name in threads)
        and type(report["native_threads"]) is int
        and type(report["cuda"]) is bool
    )


def _forget_in_child() -> None:
    """A process forked by the agent (a function worker) must not keep a zygote's socket open,
    or the zygote would outlive a dead agent: the sockets are close-on-exec, not close-on-fork."""
    for zygote in list(_zygotes):
        sock = zygote._sock
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        zygote._sock = zygote._proc = None
        zygote._closed = True


_zygotes: weakref.WeakSet[Zygote] = weakref.WeakSet()
os.register_at_fork(after_in_child=_forget_in_child)
