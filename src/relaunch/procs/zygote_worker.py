"""What a child the zygote of ``--preload`` forked runs before the worker's own code: it becomes
the worker a request describes (``become``). Read by path by
``zygote_program`` (only the standard library, nothing of relaunch's).

The child leaves the zygote's loop, drops its descriptors, takes the worker's session, signals,
streams, umask, directory, CPUs, environment, ``sys.argv`` and ``sys.path[0]``, builds a fresh
``__main__`` and runs the script (as CPython's ``PyRun_SimpleFile`` does) or the module
(``runpy._run_module_as_main``, as ``-m`` does), then returns to the top level of the
interpreter, so that its end is a normal interpreter exit: ``SystemExit``'s code, atexit
handlers, non-daemon threads joined, streams flushed; an uncaught exception is printed by
``sys.excepthook`` without the zygote's frames (exit status 1, or death by SIGINT for
``KeyboardInterrupt``, as CPython does).
"""

import os
import sys

#: ``signal`` without its Python layer (enum): the zygote's workers start with its modules.
_signal = __import__("_signal")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PR_SET_PDEATHSIG = 1


def become(zygote: "Any", request: "dict[str, Any]", fds: list[int]) -> None:
    """In the forked child: become the worker ``request`` describes, then run its code."""
    zygote.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
    if os.getppid() != zygote.pid:
        os.kill(os.getpid(), _signal.SIGKILL)  # the zygote died already: so does its worker
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
    own = {zygote.own_file, __file__, "<string>"}
    if request["module"] is not None:
        _run_module(request["module"], own, zygote.fresh_main)
    else:
        _run_script(request["script"], request["argv"][0], own, zygote.fresh_main)


def _signals_of(mask: int) -> set[int]:
    return {number for number in _signal.valid_signals() if mask >> (number - 1) & 1}


def _reset_signals(zygote: "Any", agent_ignored: int) -> None:
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


def _fresh_main(fresh: "tuple[tuple[str, Any], ...]") -> "Any":
    main = type(sys)("__main__")
    namespace = main.__dict__
    for name, value in fresh:
        namespace[name] = {} if name == "__annotations__" else value
    sys.modules["__main__"] = main
    return main


def _run_script(
    script: str, program: str, own: set[str], fresh: "tuple[tuple[str, Any], ...]"
) -> None:
    """``python script.py``, as ``PyRun_SimpleFileExFlags`` runs it."""
    namespace = _fresh_main(fresh).__dict__
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


def _run_module(name: str, own: set[str], fresh: "tuple[tuple[str, Any], ...]") -> None:
    """``python -m name``, as CPython runs it (``runpy._run_module_as_main``)."""
    _fresh_main(fresh)
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
