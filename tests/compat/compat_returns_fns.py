"""Function workers for tests/compat/test_compat_return_values.py (importable by spawned
children): each returns one kind of value, under torch's launcher or relaunch's."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def _rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def tensor() -> Any:
    import torch

    return torch.ones(2) * (_rank() + 1)


def tensor_dict() -> dict[str, Any]:
    """A state dict as a trainer returns it: tensors of several dtypes, a view, a scalar."""
    import torch

    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) + _rank()
    return {
        "weight": weight,
        "row": weight[1],
        "transposed": weight.t(),
        "bias": torch.zeros(4, dtype=torch.bfloat16),
        "steps": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "lr": 0.5,
    }


def large_tensor(mib: int) -> Any:
    import torch

    return torch.full((mib << 18,), float(_rank() + 1), dtype=torch.float32)


def several(calls: dict[str, tuple[Any, tuple[Any, ...]]]) -> dict[str, Any]:
    """Each call's value by its name: one reference run under torch's launcher serves every
    kind, where each kind's own run cost two more workers importing torch."""
    return {name: fn(*args) for name, (fn, args) in calls.items()}


def nothing() -> None:
    return None


@dataclass
class Point:
    """A plain object of a type both sides can import."""

    rank: int
    label: str


def plain_object() -> Point:
    return Point(_rank(), "point")


def numpy_array() -> Any:
    import numpy

    return numpy.arange(6, dtype=numpy.float64).reshape(2, 3) * (_rank() + 1)


# -- values relaunch cannot send or load ---------------------------------------------------------


def a_lambda() -> Any:
    return lambda: None


def a_generator() -> Iterator[int]:
    return (n for n in range(3))


def a_socket() -> socket.socket:
    return socket.socket()


#: The module name of a type only the worker has.
WORKER_ONLY_MODULE = "compat_returns_worker_only"


def worker_only_type() -> object:
    """An instance of a class whose module exists in the worker alone."""
    import types

    module = types.ModuleType(WORKER_ONLY_MODULE)
    exec("class Secret:\n    pass\n", module.__dict__)
    sys.modules[WORKER_ONLY_MODULE] = module
    return module.Secret()


class RefusesToLoad:
    """Pickles fine; its ``__setstate__`` raises wherever it is loaded."""

    def __init__(self) -> None:
        self.payload = 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("RefusesToLoad will not be unpickled")


def refuses_to_load() -> RefusesToLoad:
    return RefusesToLoad()


def sleep_then_return(seconds: float) -> int:
    time.sleep(seconds)
    return _rank()


def announce_and_sleep() -> int:
    """Leave a file named after this process in ``$ANNOUNCE_DIR``, then sleep (to be stopped)."""
    with open(os.path.join(os.environ["ANNOUNCE_DIR"], str(os.getpid())), "w"):
        pass
    time.sleep(300)
    return _rank()
