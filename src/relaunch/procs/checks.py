"""The argument checks of ``start_processes``: each error says what is wrong and how to fix it.

They run before anything is started, so that a bad call fails at once rather than half-way
through starting a group. Each error is of the type torch raises for the same mistake, so an
``except`` written for torch catches it, and is still the ``ValueError`` (or
``FileNotFoundError``) relaunch raised before, for code written against relaunch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from relaunch.core.defaults import START_METHODS


class LocalRanksError(RuntimeError, ValueError):
    """``args`` and ``envs`` do not both have the keys 0..n-1 (torch: RuntimeError)."""


class LogDirNotFoundError(FileNotFoundError, ValueError):
    """``log_dir`` does not exist (torch < 2.2: FileNotFoundError)."""


class LogDirIsFileError(NotADirectoryError, ValueError):
    """``log_dir`` is a file (torch: NotADirectoryError)."""


class LogDirNotEmptyError(RuntimeError, ValueError):
    """``log_dir`` is not empty (torch < 2.2: RuntimeError)."""


class NotExecutableError(PermissionError, FileNotFoundError):
    """A binary entrypoint that is not executable (torch: PermissionError, from starting it)."""


def check_start_method(start_method: str) -> None:
    """Raise ValueError unless ``start_method`` is a multiprocessing start method."""
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start method {start_method!r}: use one of {', '.join(START_METHODS)}"
        )


def check_picklable(
    entrypoint: Callable[..., Any], args: Mapping[int, tuple[Any, ...]], start_method: str
) -> None:
    """Raise NotPicklableError (a ValueError) when the function or its arguments cannot reach a
    spawned child."""
    import pickle

    what: object = entrypoint
    try:
        pickle.dumps(entrypoint)
        for rank, rank_args in args.items():
            what = f"the arguments of local rank {rank}"
            pickle.dumps(rank_args)
    except Exception as exc:
        raise not_picklable_error()(
            f"{what!r} cannot be pickled for start method {start_method!r} ({exc}); define "
            "the function at the top level of an importable module, or use start_method='fork'"
        ) from None


@functools.cache
def not_picklable_error() -> type[ValueError]:
    """``NotPicklableError``, made when first raised: it is pickle's ``PicklingError`` too, and
    loading pickle's module would cost every launch 0.45 ms for a check that only a function's
    workers need."""
    from pickle import PicklingError

    class NotPicklableError(ValueError, PicklingError):
        """The function or its arguments cannot reach a spawned child (torch: the
        PicklingError of starting it)."""

        __qualname__ = "NotPicklableError"

    return NotPicklableError


def __getattr__(name: str) -> object:
    if name == "NotPicklableError":
        return not_picklable_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_entrypoint(entrypoint: object, start_method: str) -> None:
    """A function needs a known start method; a binary must exist and be executable."""
    if callable(entrypoint):
        check_start_method(start_method)
    elif isinstance(entrypoint, str):
        check_binary(entrypoint)
    else:
        raise TypeError(
            f"entrypoint must be a function or the name of a binary, not {type(entrypoint)}"
        )


def check_binary(entrypoint: str) -> None:
    """Raise FileNotFoundError unless ``entrypoint`` is an executable file or on PATH
    (NotExecutableError, also a PermissionError, for a file that is not executable)."""
    if os.sep in entrypoint:
        if os.path.isfile(entrypoint) and os.access(entrypoint, os.X_OK):
            return
        if not os.path.exists(entrypoint):
            raise FileNotFoundError(f"entrypoint {entrypoint!r} does not exist")
        raise NotExecutableError(
            f"entrypoint {entrypoint!r} is not executable: chmod +x it, or run it through its "
            "interpreter"
        )
    import shutil

    found = shutil.which(entrypoint)
    if found is None:
        raise FileNotFoundError(
            f"entrypoint {entrypoint!r} was not found on PATH: give its full path or install it"
        )


def check_log_dir(log_dir: str) -> None:
    """Raise a ValueError unless ``log_dir`` is an existing empty directory (one per run); each
    is also the error torch raises: FileNotFoundError, NotADirectoryError, RuntimeError."""
    if not os.path.exists(log_dir):
        raise LogDirNotFoundError(
            f"log_dir {log_dir!r} is not an existing directory: create it first"
        )
    if not os.path.isdir(log_dir):
        raise LogDirIsFileError(
            f"log_dir {log_dir!r} is not an existing directory, it is a file: give an empty "
            "directory"
        )
    if os.listdir(log_dir):
        raise LogDirNotEmptyError(
            f"log_dir {log_dir!r} is not empty: give each run an empty directory"
        )


def check_ranks(args: Mapping[int, Any], envs: Mapping[int, Any]) -> int:
    """The number of local ranks; LocalRanksError (a RuntimeError and a ValueError) unless args
    and envs both have keys 0..n-1."""
    nprocs = max(len(args), len(envs))
    expected = set(range(nprocs))
    problems = []
    for label, given in (("args", args), ("envs", envs)):
        missing = sorted(expected - set(given))
        extra = sorted(set(given) - expected)
        if missing:
            problems.append(f"{label} is missing local ranks {missing}")
        if extra:
            problems.append(f"{label} has unexpected keys {extra}")
    if problems or nprocs == 0:
        detail = "; ".join(problems) or "no ranks given"
        raise LocalRanksError(
            f"args and envs must both have the keys 0..nprocs-1 (one per local rank): {detail}"
        )
    return nprocs
