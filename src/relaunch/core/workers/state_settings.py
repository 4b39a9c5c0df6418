"""How an agent keeps its workers' state (``--state-memory``, ``--state-dir``,
``--state-persist-every``, ``--jit-save-timeout``, ``--state-replicas``,
``--state-copy-every``): the typed settings,
checked once, and the sizes people write (``8G``)."""

from __future__ import annotations

import re

from relaunch.core.value import Value

#: ``--state-memory``'s default: this share of the machine's memory.
DEFAULT_MEMORY_SHARE = 0.25
DEFAULT_PERSIST_EVERY = 10
DEFAULT_JIT_SAVE_TIMEOUT = 10.0
DEFAULT_REPLICAS = 1
DEFAULT_COPY_EVERY = 1


class StateSettings(Value):
    """How an agent keeps its workers' state: ``memory`` bytes of shared memory at most (None:
    ``default_memory``); a copy in ``directory`` every ``persist_every`` saves of each rank and
    at the job's end (None: none); ``jit_save_timeout`` seconds for the listening workers'
    saves when a failure is pending (0: none); a copy on each of the ``replicas`` next nodes
    in ring order (0: none), of the saves of every ``copy_every``-th step (every node copies
    the same steps, and keeps its own two newest of them)."""

    __slots__ = (
        "copy_every",
        "directory",
        "jit_save_timeout",
        "memory",
        "persist_every",
        "replicas",
    )

    memory: int | None
    directory: str | None
    persist_every: int
    jit_save_timeout: float
    replicas: int
    copy_every: int

    def __init__(
        self,
        memory: int | None = None,
        directory: str | None = None,
        persist_every: int = DEFAULT_PERSIST_EVERY,
        jit_save_timeout: float = DEFAULT_JIT_SAVE_TIMEOUT,
        replicas: int = DEFAULT_REPLICAS,
        copy_every: int = DEFAULT_COPY_EVERY,
    ) -> None:
        self._set(
            memory=memory,
            directory=directory,
            persist_every=persist_every,
            jit_save_timeout=jit_save_timeout,
            replicas=replicas,
            copy_every=copy_every,
        )
        if self.memory is not None and (isinstance(self.memory, bool) or self.memory <= 0):
            raise ValueError(f"state memory must be a number of bytes > 0, got {self.memory!r}")
        if isinstance(self.persist_every, bool) or not (
            isinstance(self.persist_every, int) and self.persist_every >= 1
        ):
            raise ValueError(
                f"state_persist_every must be a whole number >= 1, got {self.persist_every!r}"
            )
        if not (isinstance(self.jit_save_timeout, (int, float)) and self.jit_save_timeout >= 0):
            raise ValueError(
                f"jit_save_timeout must be seconds >= 0, got {self.jit_save_timeout!r}"
            )
        if isinstance(self.replicas, bool) or not (
            isinstance(self.replicas, int) and self.replicas >= 0
        ):
            raise ValueError(f"state_replicas must be a whole number >= 0, got {self.replicas!r}")
        if isinstance(self.copy_every, bool) or not (
            isinstance(self.copy_every, int) and self.copy_every >= 1
        ):
            raise ValueError(
                f"state_copy_every must be a whole number >= 1, got {self.copy_every!r}"
            )


def default_memory(machine_bytes: int) -> int:
    """``--state-memory`` when none is given: a quarter of the machine's memory."""
    return int(machine_bytes * DEFAULT_MEMORY_SHARE)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
#: Compiled where first used (``re`` keeps it): only ``--state-memory`` needs it.
_SIZE = r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*"


def parse_bytes(text: str) -> int:
    """``512M``, ``8G``, ``1.5GiB`` or a number of bytes (K, M, G, T: powers of 1024)."""
    match = re.fullmatch(_SIZE, text, re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: give bytes or a number with K, M, G or T (e.g. 8G)"
        )
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"a state memory bound must be more than 0 bytes, got {text!r}")
    return size
