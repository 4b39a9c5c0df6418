"""The zygote of ``--preload``, its main program: a Python process that imported the preloaded
modules and forks each Python worker from itself (the agent's side is ``procs.zygote``; what
a forked child runs is ``procs.zygote_worker``; the messages, ``procs.zygote_wire``).

The agent starts it as ``PYTHON [-u] -c BOOT <this file> <socket fd> preload=...``: the file is
read and run by path, and reads its two siblings by path too (``_load``), so that the zygote
imports nothing of relaunch's (not even its package) and runs under any Python the workers use.
Its life, in order (``main``):

1. read its setup from the socket (the modules, the ``sys.argv`` and ``sys.path[0]`` a worker
   would import them with, the agent's pid), and note the signal dispositions a fresh
   interpreter has;
2. import the modules, note which signals the imports took over, fork once and reap at once
   (so that libraries that stop their threads at fork, as OpenBLAS does, have done so), count
   the threads left (a Python thread would be missing in every worker: the agent then starts
   the workers cold), put every object left in the collector's permanent generation
   (``_freeze_objects``), and say "ready" (or why not) on the socket;
3. serve: each request carries its number, a worker's command line, environment, working
   directory, CPUs, signal state and its stdin, stdout and stderr (``SCM_RIGHTS``); the zygote
   forks, replies (``send_reply``: the request's number and the pid, fixed-size) with the read
   end of a pipe where the 4-byte wait status will be written once the zygote reaped the
   worker (SIGCHLD through ``signal.set_wakeup_fd``, no polling), and a pidfd of the worker
   where the kernel has them. It reaps a child only once the agent said it checked the reply
   (``{"checked": pid}``): until then the child is there to be checked, a zombie at worst;
4. the forked child becomes the worker (``zygote_worker.become``).

The zygote leaves at the end of its socket (the agent closed it, or died however it died), and
with its parent (``PR_SET_PDEATHSIG``); its children die with it (the same), so that a worker
never outlives the process that would report its exit status. It blocks the signals a batch
system sends to every process of a job (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2):
those are for the agent and the workers, never a reason for the zygote to go.

Only the standard library, and only what a fresh interpreter has loaded already or what is
light: the workers start with this process's modules.
"""

import _socket
import os
import select
import sys

#: ``signal`` without its Python layer (enum): the zygote's workers start with its modules.
_signal = __import__("_signal")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: The entries of a fresh ``__main__`` (``add_main_module``), in order, before any code ran: the
#: template of each worker's ``__main__``. Read first thing, while this file runs in the
#: interpreter's own ``__main__``; ``__doc__`` is None there (this file's docstring set it).
_FRESH_MAIN = tuple(
    (name, None if name == "__doc__" else value)
    for name, value in dict(globals()).items()
    if name
    in (
        "__name__",
        "__doc__",
        "__package__",
        "__loader__",
        "__spec__",
        "__annotations__",
        "__builtins__",
    )
)

#: Signals a batch system sends to every process of a job: blocked in the zygote (never ignored:
#: a blocked signal leaves the dispositions as the preloaded modules set them, and a fork's
#: child starts with no pending signal).
_BLOCKED = (
    _signal.SIGTERM,
    _signal.SIGINT,
    _signal.SIGHUP,
    _signal.SIGQUIT,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
)


def _load(name: str) -> "Any":
    """The sibling ``name``.py of this program, read and run by path as this one is (as a
    module of its own, not in ``sys.modules``)."""
    path = os.path.join(os.path.dirname(sys.argv[1]), name + ".py")
    module = type(sys)(name)
    module.__file__ = path
    with open(path, "rb") as file:
        exec(compile(file.read(), path, "exec"), module.__dict__)
    return module


_wire = _load("zygote_wire")
_worker = _load("zygote_worker")


class _Zygote:
    """What the zygote knows while it serves, and what each worker forked from it undoes."""

    def __init__(self, sock: _socket.socket, own_file: str) -> None:
        self.sock = sock
        self.own_file = own_file
        self.pid = os.getpid()
        #: The signals caught and ignored by a fresh interpreter, and those the preloaded
        #: modules changed (their dispositions are the modules' own: kept in the workers).
        self.fresh_caught = 0
        self.preload_changed = 0
        #: ``sys.path``'s entry a worker's ``sys.path[0]`` stands in (found by identity).
        self.path_marker: str | None = None
        #: Modules the zygote imported for itself after the preload: dropped from a worker's
        #: ``sys.modules`` where they are plain Python (a later import loads them afresh).
        self.own_modules: list[str] = []
        self.prctl: Any = None
        #: The interpreter's fresh ``__main__`` (a worker's starts so).
        self.fresh_main = _FRESH_MAIN
        self.wake_r = -1
        self.wake_w = -1
        #: The status pipe's write end of each child, by pid.
        self.children: dict[int, int] = {}
        #: The children whose reply the agent has not said it checked: not reaped yet.
        self.unchecked: set[int] = set()


def main() -> None:
    """The zygote's life: its setup, the preload, its report, then serving; returns only in a
    forked child, once that became a worker and ran its code."""
    for fd in (0, 1, 2):  # a descriptor received later must never land on one of these
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    sock = _socket.socket(fileno=int(sys.argv[2]))
    got = _wire.receive_message(sock, 0)
    if got is None:
        os._exit(0)
    setup = got[0]
    assert isinstance(setup, dict)
    zygote = _Zygote(sock, sys.argv[1])
    report = _preload_report(zygote, setup)
    zygote.prctl(_worker.PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    if os.getppid() != setup["agent"]:
        os._exit(0)  # the agent died before the zygote could die with it
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _BLOCKED)
    _wake_on_children(zygote)
    _wire.send_message(sock, report)
    if report["error"] is not None:
        os._exit(1)
    request, fds = _serve(zygote)
    _worker.become(zygote, request, fds)


def _preload_report(zygote: _Zygote, setup: "dict[str, Any]") -> "dict[str, Any]":
    """Import the modules as a worker would, settle, freeze; the report the agent reads."""
    zygote.fresh_caught, fresh_ignored = _dispositions()
    path0 = setup["path0"]
    if path0 is not None and sys.path and sys.path[0] == "":  # -c's entry (none with -P)
        zygote.path_marker = (path0 + "/")[:-1]  # an object of its own: found by identity
        sys.path[0] = zygote.path_marker
    sys.argv = list(setup["argv"])
    error = _preload(setup["preload"])
    caught, ignored = _dispositions()
    zygote.preload_changed = (caught ^ zygote.fresh_caught) | (ignored ^ fresh_ignored)
    python_threads = _python_threads()
    _prime_fork()
    native_threads = _native_threads() - 1 - len(python_threads)
    cuda = _cuda_initialised()
    before = set(sys.modules)
    import ctypes

    zygote.prctl = ctypes.CDLL(None, use_errno=True).prctl
    zygote.own_modules = [
        name
        for name in set(sys.modules) - before
        if str(getattr(sys.modules[name], "__file__", "")).endswith(".py")
    ]
    _freeze_objects()
    return {
        "error": error,
        "pid": zygote.pid,
        "python_threads": python_threads,
        "native_threads": native_threads,
        "cuda": cuda,
    }


def _wake_on_children(zygote: _Zygote) -> None:
    """SIGCHLD writes a byte on the wake-up pipe, which wakes the loop to reap."""
    zygote.wake_r, zygote.wake_w = os.pipe()
    os.set_blocking(zygote.wake_r, False)
    os.set_blocking(zygote.wake_w, False)
    _signal.set_wakeup_fd(zygote.wake_w, warn_on_full_buffer=False)
    _signal.signal(_signal.SIGCHLD, _on_child)


def _on_child(signum: int, frame: object) -> None:
    """SIGCHLD: nothing here; its byte on the wake-up pipe wakes the loop, which reaps."""


def _preload(names: list[str]) -> str | None:
    """Import ``names``; None, or what went wrong in one line (a failure that is not the
    module's absence also prints its traceback, as a cold worker would)."""
    for name in names:
        try:
            __import__(name)
        except BaseException as exc:
            if not (isinstance(exc, ModuleNotFoundError) and name.startswith(str(exc.name))):
                import traceback

                traceback.print_exc()
            text = " ".join(str(exc).split()) or "(no message)"
            return f"cannot import {name}: {type(exc).__name__}: {text}"
    return None


def _freeze_objects() -> None:
    """Collect the imports' garbage, then freeze what is left (``gc.freeze``): a collection in a
    worker never walks the zygote's objects. Walking them writes to each one's header, so
    every worker would copy the pages that hold them: with torch and torch._dynamo preloaded,
    a worker's first full collection copied 72 MB and took 0.16-0.21 s, and 4 restarted ranks
    on 2 cores stalled 0.50-0.66 s each about 2 s into their training; frozen, 0.4-4.6 ms."""
    import gc

    gc.collect()
    gc.freeze()


def _status_fields() -> dict[str, str]:
    try:
        with open("/proc/self/status") as file:
            lines = file.read().splitlines()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in lines if ":" in line)


def _dispositions() -> tuple[int, int]:
    """The process's caught and ignored signals, as masks (bit n-1: signal n)."""
    fields = _status_fields()
    return int(fields.get("SigCgt", "0").strip(), 16), int(fields.get("SigIgn", "0").strip(), 16)


def _python_threads() -> list[str]:
    threading = sys.modules.get("threading")
    if threading is None:
        return []
    main_thread = threading.main_thread()
    return [thread.name for thread in threading.enumerate() if thread is not main_thread]


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _prime_fork() -> None:
    """Fork once and reap at once: the libraries' fork handlers (OpenBLAS stops its threads)
    run before the threads are counted, as they will before every worker's fork."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _cuda_initialised() -> bool:
    cuda = sys.modules.get("torch.cuda")
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:
        return False


def _serve(zygote: _Zygote) -> "tuple[dict[str, Any], list[int]]":
    """Fork a worker for each request until the socket ends; returns only in a forked child."""
    sock = zygote.sock
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(zygote.wake_r, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if zygote.wake_r in ready:
            _drain(zygote.wake_r)
            _reap(zygote)
        if sock.fileno() not in ready:
            continue
        try:
            got = _wire.receive_message(sock, 3)
        except (OSError, EOFError, ValueError):
            got = None
        if got is None:
            os._exit(0)  # the agent closed the socket, or died: the workers die with this
        request, fds = got
        assert isinstance(request, dict)
        if "checked" in request:
            zygote.unchecked.discard(request["checked"])
            _reap(zygote)
            continue
        status_r, status_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _signal.set_wakeup_fd(-1)
            sock.close()
            for fd in (zygote.wake_r, zygote.wake_w, status_r, status_w, *zygote.children.values()):
                os.close(fd)
            return request, fds
        for fd in fds:
            os.close(fd)
        zygote.children[pid] = status_w
        zygote.unchecked.add(pid)
        sent = [status_r]
        pidfd = _pidfd(pid)
        if pidfd >= 0:
            sent.append(pidfd)
        try:
            _wire.send_reply(sock, request["seq"], pid, sent)
        except OSError:
            os._exit(0)  # the agent is gone
        finally:
            for fd in sent:
                os.close(fd)


def _pidfd(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(zygote: _Zygote) -> None:
    """Reap every child that ended, but those the agent has not checked yet, and write its
    wait status into its pipe."""
    children = zygote.children
    for pid in [pid for pid in children if pid not in zygote.unchecked]:
        try:
            reaped, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already: nothing to say
            os.close(children.pop(pid))
            continue
        if reaped == 0:
            continue
        fd = children.pop(pid)
        try:
            os.write(fd, status.to_bytes(_wire.INT_SIZE, "little"))
        except OSError:
            pass  # the agent let go of it
        os.close(fd)


if __name__ == "__main__":
    main()
