"""What the zygote of ``--preload`` can fork, decided in the agent: a worker's command read as
Python's (``python_command``), the variables that must match the zygote's
(``startup_variables``), and the request that forks it as the calling thread would start it
(``worker_request``, from ``caller``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import zipimport
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The interpreter options a zygote and its workers may have (one set per zygote).
OPTIONS = frozenset({"-u"})
#: Variables the interpreter reads as it starts: a worker whose values differ starts cold.
LOCALE_VARIABLES = ("LANG", "LC_ALL", "LC_CTYPE")
#: A name the workers' Python may have, when it is not the launcher's own.
_PYTHON_NAME = re.compile(r"python[0-9.]*[a-z]?(\.exe)?")


@dataclass(frozen=True)
class PythonCommand:
    """A worker's command line read as ``python [OPTIONS] script ARGS`` or ``python [OPTIONS]
    -m module ARGS``."""

    python: str
    options: tuple[str, ...]
    script: str | None
    module: str | None
    args: tuple[str, ...]

    @property
    def sys_argv(self) -> list[str]:
        """``sys.argv`` as the interpreter sets it before the code runs (``-m``: runpy puts the
        module's path in place of ``-m``)."""
        return ["-m" if self.module is not None else str(self.script), *self.args]

    def path0(self, cwd: str) -> str:
        """``sys.path[0]`` for a worker started in ``cwd``: the script's directory, symbolic
        links resolved (``-m``: ``cwd``), as CPython computes it."""
        if self.script is None:
            return cwd
        return os.path.dirname(os.path.realpath(os.path.join(cwd, self.script)))


def python_command(argv: Sequence[str], python_names: Sequence[str] = ()) -> PythonCommand | None:
    """``argv`` as a Python worker's command the zygote can run, or None: not a Python
    (``argv[0]`` is neither one of ``python_names``, the launcher's ``sys.executable`` nor named
    ``python...``), options other than ``OPTIONS``, ``-c`` or stdin."""
    if not argv:
        return None
    python = argv[0]
    known = (sys.executable, os.environ.get("PYTHON_EXEC", ""), *python_names)
    if python not in known and not _PYTHON_NAME.fullmatch(os.path.basename(python)):
        return None
    options: list[str] = []
    rest = list(argv[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-":
        option = rest.pop(0)
        if option == "-m" and rest:
            return PythonCommand(python, tuple(options), None, rest[0], tuple(rest[1:]))
        if option not in OPTIONS or option in options:
            return None
        options.append(option)
    if not rest or rest[0] == "-":
        return None
    return PythonCommand(python, tuple(options), rest[0], None, tuple(rest[1:]))


def startup_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the interpreter reads as it starts."""
    return {
        name: value
        for name, value in env.items()
        if name.startswith("PYTHON") or name in LOCALE_VARIABLES
    }


@dataclass
class Caller:
    """What a process started now by the calling thread would inherit from it."""

    cwd: str
    cpus: list[int]
    blocked: int
    ignored: int
    umask: int


def caller() -> Caller:
    """What a process started now by the calling thread would inherit from it (OSError: it
    cannot be read)."""
    fields: dict[str, str] = {}
    for path in ("/proc/thread-self/status", f"/proc/self/task/{threading.get_native_id()}/status"):
        try:
            with open(path) as file:
                fields = dict(line.split(":", 1) for line in file if ":" in line)
            break
        except OSError:
            continue
    if "Umask" in fields:
        umask = int(fields["Umask"].strip(), 8)
    else:
        umask = os.umask(0o022)
        os.umask(umask)
    return Caller(
        os.getcwd(),
        sorted(os.sched_getaffinity(0)),
        int(fields.get("SigBlk", "0").strip(), 16),
        int(fields.get("SigIgn", "0").strip(), 16),
        umask,
    )


def _valid(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def runs_as_popen_would(command: PythonCommand, env: Mapping[str, str]) -> bool:
    """Whether a fork of the zygote runs ``command`` with ``env`` as ``Popen`` would: an
    environment ``Popen`` takes, and a script that is a file (not bytecode, not a zip
    application, which runpy runs by its ``__main__``)."""
    if any("=" in name or "\0" in name or "\0" in value for name, value in env.items()):
        return False  # what Popen refuses, it refuses the same way
    script = command.script
    if script is not None:
        if not os.path.isfile(script) or script.endswith(".pyc"):
            return False  # as CPython runs it, or says it cannot
        try:
            zipimport.zipimporter(script)
        except zipimport.ZipImportError:
            pass
        else:
            return False  # a zip application: runpy runs its __main__
    return True


def worker_request(
    argv: Sequence[str],
    command: PythonCommand,
    env: Mapping[str, str],
    stdout: int | None,
    stderr: int | None,
    parent: Caller,
) -> tuple[dict[str, Any], list[int]]:
    """The request that forks the worker ``argv`` as ``parent`` would start it, and the
    descriptors it sends: stdin, and ``stdout`` and ``stderr`` (None: the agent's)."""
    streams = [fd for fd in (0, 1, 2) if _valid(fd)]
    given = {1: stdout, 2: stderr}
    sent = [fd for fd in (0, 1, 2) if given.get(fd) is not None or fd in streams]
    fds = [fd if given.get(fd) is None else given[fd] for fd in sent]
    request = {
        "argv": list(argv),
        "sys_argv": command.sys_argv,
        "script": command.script,
        "module": command.module,
        "path0": command.path0(parent.cwd),
        "env": dict(env),
        "cwd": parent.cwd,
        "cpus": parent.cpus,
        "blocked": parent.blocked,
        "ignored": parent.ignored,
        "umask": parent.umask,
        "streams": sent,
    }
    return request, [fd for fd in fds if fd is not None]
