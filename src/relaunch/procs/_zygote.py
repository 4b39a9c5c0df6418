"""The zygote of ``--preload``: a Python process that imported the preloaded modules and forks
each Python worker from itself (the agent's side is ``relaunch.procs.zygote``).

The agent starts it as ``PYTHON [-u] -c BOOT <this file> <socket fd> preload=...``: the file is
read and run by path, so that the zygote imports nothing of relaunch's (not even its package)
and runs under any Python the workers use. Its life, in order (``main``):

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
4. the forked child (``_become``) leaves the zygote's loop, drops its descriptors, takes the
   worker's session, signals, streams, umask, directory, CPUs, environment, ``sys.argv`` and
   ``sys.path[0]``, builds a fresh ``__main__`` and runs the script (as CPython's
   ``PyRun_SimpleFile`` does) or the module (``runpy._run_module_as_main``, as ``-m`` does),
   then returns to the top level of the interpreter, so that its end is a normal interpreter
   exit: ``SystemExit``'s code, atexit handlers, non-daemon threads joined, streams flushed;
   an uncaught exception is printed by ``sys.excepthook`` without the zygote's frames (exit
   status 1, or death by SIGINT for ``KeyboardInterrupt``, as CPython does). A request for
   torch's store instead (``torch_store``: with a listening socket and a pipe, no streams)
   makes the child serve torch's ``TCPStore`` on that socket until it is killed.

The zygote leaves at the end of its socket (the agent closed it, or died however it died), and
with its parent (``PR_SET_PDEATHSIG``); its children die with it (the same), so that a worker
never outlives the process that would report its exit status. It blocks the signals a batch
system sends to every process of a job (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2):
those are for the agent and the workers, never a reason for the zygote to go.

Only the standard library, and only what a fresh interpreter has loaded already or what is
light: the workers start with this process's modules.
"""

import _socket
import marshal
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

# -- the wire: both sides ------------------------------------------------------------------------

#: A message: its length (4 bytes, little-endian), then ``marshal`` data (version 4, which every
#: Python 3 reads); descriptors ride with its first byte. The agent's requests are up to
#: ``MAX_MESSAGE`` bytes (an environment is large at most); the zygote's report on its imports is
#: read by the agent up to ``MAX_REPORT``.
HEADER = 4
MARSHAL_VERSION = 4
INT_SIZE = 4
MAX_MESSAGE = 64 << 20
MAX_REPORT = 1 << 20
#: A reply to a request, fixed-size (no marshal data from the zygote's side once workers run):
#: the request's number (8 bytes) and the forked pid (4), little-endian; its descriptors (the
#: status pipe's read end, then the child's pidfd where there are pidfds) ride with its first byte.
SEQ_SIZE = 8
REPLY_SIZE = SEQ_SIZE + INT_SIZE


def send_message(
    sock: _socket.socket, message: "Any", fds: list[int] | tuple[int, ...] = ()
) -> None:
    """Send ``message`` (marshal-able) and the descriptors ``fds`` on the stream ``sock``."""
    payload = marshal.dumps(message, MARSHAL_VERSION)
    _send(sock, len(payload).to_bytes(HEADER, "little") + payload, fds)


def send_reply(sock: _socket.socket, seq: int, pid: int, fds: list[int]) -> None:
    """Answer request ``seq``: ``pid`` forked, with the descriptors ``fds``."""
    _send(sock, seq.to_bytes(SEQ_SIZE, "little") + pid.to_bytes(INT_SIZE, "little"), fds)


def _send(sock: _socket.socket, data: bytes, fds: "list[int] | tuple[int, ...]") -> None:
    ancillary = []
    if fds:
        blob = b"".join(fd.to_bytes(INT_SIZE, sys.byteorder, signed=True) for fd in fds)
        ancillary.append((_socket.SOL_SOCKET, _socket.SCM_RIGHTS, blob))
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive_message(
    sock: _socket.socket, max_fds: int, max_size: int = MAX_MESSAGE
) -> "tuple[Any, list[int]] | None":
    """The next message on ``sock`` and the descriptors that came with it (close-on-exec), or
    None at the end of the stream. EOFError when the stream ends inside a message, ValueError
    when it says it is longer than ``max_size`` bytes or its data is not marshal's."""
    data, ancillary, flags, _ = sock.recvmsg(
        HEADER, _socket.CMSG_SPACE(max(1, max_fds) * INT_SIZE), _socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, blob in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(blob) - len(blob) % INT_SIZE
            fds.extend(
                int.from_bytes(blob[at : at + INT_SIZE], sys.byteorder, signed=True)
                for at in range(0, usable, INT_SIZE)
            )
    try:
        if not data:
            if fds:
                raise EOFError("descriptors came without a message")
            return None
        if flags & _socket.MSG_CTRUNC:
            raise OSError("descriptors were lost in transit (MSG_CTRUNC)")
        data = _read_exactly(sock, data, HEADER)
        size = int.from_bytes(data, "little")
        if size > max_size:
            raise ValueError(f"a message of {size} bytes (at most {max_size})")
        payload = _read_exactly(sock, b"", size)
        return marshal.loads(payload), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_exactly(sock: _socket.socket, data: bytes, size: int) -> bytes:
    chunks = [data]
    left = size - len(data)
    while left > 0:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the stream ended inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# -- the zygote ------------------------------------------------------------------------------------

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
PR_SET_PDEATHSIG = 1


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
        self.wake_r = -1
        self.wake_w = -1
        #: The status pipe's write end of each child, by pid.
        self.children: dict[int, int] = {}
        #: The children whose reply the agent has not said it checked: not reaped yet.
        self.unchecked: set[int] = set()


def main() -> None:
    for fd in (0, 1, 2):  # a descriptor received later must never land on one of these
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    own_file = sys.argv[1]
    sock = _socket.socket(fileno=int(sys.argv[2]))
    got = receive_message(sock, 0)
    if got is None:
        os._exit(0)
    setup = got[0]
    assert isinstance(setup, dict)
    zygote = _Zygote(sock, own_file)
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

    libc = ctypes.CDLL(None, use_errno=True)
    zygote.prctl = libc.prctl
    zygote.own_modules = [
        name
        for name in set(sys.modules) - before
        if str(getattr(sys.modules[name], "__file__", "")).endswith(".py")
    ]
    _freeze_objects()
    libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    if os.getppid() != setup["agent"]:
        os._exit(0)  # the agent died before the zygote could die with it
    _signal.pthread_sigmask(_signal.SIG_BLOCK, _BLOCKED)
    zygote.wake_r, zygote.wake_w = os.pipe()
    os.set_blocking(zygote.wake_r, False)
    os.set_blocking(zygote.wake_w, False)
    _signal.set_wakeup_fd(zygote.wake_w, warn_on_full_buffer=False)
    _signal.signal(_signal.SIGCHLD, _on_child)
    send_message(
        sock,
        {
            "error": error,
            "pid": zygote.pid,
            "python_threads": python_threads,
            "native_threads": native_threads,
            "cuda": cuda,
        },
    )
    if error is not None:
        os._exit(1)
    request, fds = _serve(zygote)
    _become(zygote, request, fds)


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
            got = receive_message(sock, 3)
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
            send_reply(sock, request["seq"], pid, sent)
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
            os.write(fd, status.to_bytes(INT_SIZE, "little"))
        except OSError:
            pass  # the agent let go of it
        os.close(fd)


# -- the worker ------------------------------------------------------------------------------------


def _become(zygote: _Zygote, request: "dict[str, Any]", fds: list[int]) -> None:
    """In the forked child: become the worker ``request`` describes, then run its code."""
    zygote.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    if os.getppid() != zygote.pid:
        os.kill(os.getpid(), _signal.SIGKILL)  # the zygote died already: so does its worker
    if "torch_store" in request:
        _serve_torch_store(request["torch_store"], fds)
    try:
        os.setsid()
        _reset_signals(zygote, request["ignored"])
        _take_streams(request["streams"], fds)
        os.umask(request["umask"])
        os.chdir(request["cwd"])
        if request["cpus"]:
            try:
                os.sched_setaffinity(0, request["cpus"])
            except OSError:
                pass  # a CPU set that changed meanwhile: the zygote's CPUs, as the agent's
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["sys_argv"])
        if hasattr(sys, "orig_argv"):
            sys.orig_argv = list(request["argv"])
        for index, entry in enumerate(sys.path):
            if entry is zygote.path_marker:
                sys.path[index] = request["path0"]
                break
        for name in zygote.own_modules:
            sys.modules.pop(name, None)
        _reseed()
        _signal.pthread_sigmask(_signal.SIG_SETMASK, _signals_of(request["blocked"]))
    except BaseException as exc:
        os.write(2, f"relaunch: cannot start the worker from the zygote: {exc!r}\n".encode())
        os._exit(1)
    own = {zygote.own_file, "<string>"}
    if request["module"] is not None:
        _run_module(request["module"], own)
    else:
        _run_script(request["script"], request["argv"][0], own)


def _serve_torch_store(where: "dict[str, Any]", fds: list[int]) -> None:
    """In a forked child: serve torch's ``TCPStore`` on the socket ``fds[0]``, which the agent
    bound and listens on (workers that came early wait in its backlog), until killed; a byte
    on the pipe ``fds[1]`` says it serves, its end without one that it could not (why: on the
    zygote's stderr, the agent's; ``relaunch.agent.torch_store``)."""
    port = where["port"]
    try:
        listener, ready = fds
        os.setsid()
        os.chdir("/")
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(
            where["host"],
            port,
            None,
            True,
            timedelta(seconds=where["timeout"]),
            wait_for_workers=False,
            master_listen_fd=listener,
        )
    except BaseException as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        os.write(2, f"relaunch: cannot serve torch's store on port {port}: {text}\n".encode())
        os._exit(1)
    os.write(ready, b"1")
    os.close(ready)
    for number in _BLOCKED:
        _signal.signal(number, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
    while store is not None:  # its threads serve; this one waits for the end
        _signal.pause()


def _signals_of(mask: int) -> set[int]:
    return {number for number in _signal.valid_signals() if mask >> (number - 1) & 1}


def _reset_signals(zygote: _Zygote, agent_ignored: int) -> None:
    """Each signal as a fresh interpreter started by the agent now has it (what the agent
    ignores stays ignored, as across exec; Python's own: SIGINT raises KeyboardInterrupt,
    SIGPIPE and SIGXFSZ ignored), but those the preloaded modules or the interpreter's start
    (faulthandler) took over, which are theirs."""
    _signal.set_wakeup_fd(-1)
    own_ignored = {getattr(_signal, name, 0) for name in ("SIGPIPE", "SIGXFSZ")} - {0}
    for number in _signal.valid_signals():
        if number in (_signal.SIGKILL, _signal.SIGSTOP):
            continue
        bit = 1 << (number - 1)
        if zygote.preload_changed & bit:
            continue
        ignored = bool(agent_ignored & bit)
        if number == _signal.SIGINT:
            wanted = _signal.SIG_IGN if ignored else _signal.default_int_handler
        elif number in own_ignored:
            wanted = _signal.SIG_IGN
        elif zygote.fresh_caught & bit:
            continue  # faulthandler's, enabled at the interpreter's start
        else:
            wanted = _signal.SIG_IGN if ignored else _signal.SIG_DFL
        try:
            _signal.signal(number, wanted)
        except (OSError, ValueError):
            pass


def _take_streams(streams: list[int], fds: list[int]) -> None:
    """Put ``fds`` on the standard descriptors ``streams`` (those not given are closed, as the
    agent's own were), and make ``sys.stdin``, ``stdout`` and ``stderr`` as CPython does at
    start (``create_stdio``): line-buffered on a terminal, stderr always, none with ``-u``."""
    if len(streams) != len(fds):
        raise OSError(f"{len(fds)} descriptors came for the streams {streams}")
    for target, fd in zip(streams, fds):  # noqa: B905 - lengths checked (3.10 has strict)
        os.dup2(fd, target)
    for fd in fds:
        if fd not in streams:
            os.close(fd)
    for target in (0, 1, 2):
        if target not in streams:
            try:
                os.close(target)
            except OSError:
                pass
    import io

    buffered = not getattr(sys.__stdout__, "write_through", False)  # -u, PYTHONUNBUFFERED
    old_out, old_err = sys.__stdout__, sys.__stderr__
    encoding = getattr(old_out, "encoding", None) or "utf-8"
    errors = getattr(old_out, "errors", None) or "strict"
    old_in = sys.__stdin__
    in_encoding = getattr(old_in, "encoding", None) or encoding
    in_errors = getattr(old_in, "errors", None) or errors
    err_errors = getattr(old_err, "errors", None) or "backslashreplace"
    for name, stream in (
        ("stdin", _stdio(io, 0, False, "<stdin>", in_encoding, in_errors, buffered)),
        ("stdout", _stdio(io, 1, True, "<stdout>", encoding, errors, buffered)),
        ("stderr", _stdio(io, 2, True, "<stderr>", encoding, err_errors, buffered)),
    ):
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _stdio(
    io: "Any", fd: int, write: bool, name: str, encoding: str, errors: str, buffered: bool
) -> "Any":
    try:
        os.fstat(fd)
    except OSError:
        return None
    buffering = 0 if write and not buffered else -1
    stream = io.open(fd, "wb" if write else "rb", buffering, None, None, None, False)
    raw = stream.raw if buffering else stream
    raw.name = name
    line_buffering = buffered and (raw.isatty() or fd == 2)
    text = io.TextIOWrapper(stream, encoding, errors, "\n", line_buffering, not buffered)
    text.mode = "w" if write else "r"
    return text


def _reseed() -> None:
    """numpy's global generator was seeded when the zygote imported it: seed it afresh, as a
    worker's own import would (Python's ``random`` reseeds itself at fork)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        try:
            numpy_random.seed()
        except Exception:
            pass


def _fresh_main() -> "Any":
    main = type(sys)("__main__")
    namespace = main.__dict__
    for name, value in _FRESH_MAIN:
        namespace[name] = {} if name == "__annotations__" else value
    sys.modules["__main__"] = main
    return main


def _run_script(script: str, program: str, own: set[str]) -> None:
    """``python script.py``, as ``PyRun_SimpleFileExFlags`` runs it."""
    namespace = _fresh_main().__dict__
    filename = os.path.abspath(script)
    namespace["__file__"] = filename
    namespace["__cached__"] = None
    try:
        with open(filename, "rb") as file:
            source = file.read()
    except OSError as exc:
        print(
            f"{program}: can't open file {filename!r}: [Errno {exc.errno}] {exc.strerror}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    loader = sys.modules["_frozen_importlib_external"].SourceFileLoader
    namespace["__loader__"] = loader("__main__", filename)
    try:
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    except SystemExit:
        raise  # the interpreter's exit, __file__ still set (as CPython leaves it)
    except BaseException as exc:
        _said_uncaught(exc, own)
        _forget_file(namespace)
        raise
    _forget_file(namespace)


def _forget_file(namespace: "dict[str, Any]") -> None:
    namespace.pop("__file__", None)
    namespace.pop("__cached__", None)


def _run_module(name: str, own: set[str]) -> None:
    """``python -m name``, as CPython runs it (``runpy._run_module_as_main``)."""
    _fresh_main()
    import runpy

    try:
        runpy._run_module_as_main(name)  # type: ignore[attr-defined]
    except SystemExit:
        raise
    except BaseException as exc:
        _said_uncaught(exc, own)
        raise


def _said_uncaught(exc: BaseException, own: set[str]) -> None:
    """Print ``exc`` with ``sys.excepthook`` as the top level would, without the zygote's
    frames; the top level, which it reaches next, then only ends the interpreter (exit status
    1, or SIGINT for KeyboardInterrupt) and calls a hook that says nothing again."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in own:
        tb = tb.tb_next
    exc.__traceback__ = tb  # what the hook shows (it prints the exception's own traceback)
    hook = sys.excepthook
    try:
        hook(type(exc), exc, tb)
    except BaseException:
        sys.__excepthook__(type(exc), exc, tb)

    def already_said(*_: object) -> None:
        sys.excepthook = hook

    sys.excepthook = already_said


if __name__ == "__main__":
    main()
