"""The rendezvous handler interface the agent drives (``backends`` builds one by name).

This module imports no handler, so every handler can import it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relaunch.core.rendezvous.membership import MembershipChange, decode_change
from relaunch.core.rendezvous.rdzv_conf import redacted
from relaunch.core.run.exclusion import NodeRecord, decode_record
from relaunch.core.value import DataclassMethods
from relaunch.rendezvous.info import RendezvousInfo, RendezvousStoreInfo
from relaunch.runtime import ExplainedError

__all__ = [
    "JobFailedError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "rendezvous_handler_registry",
]


class RendezvousError(Exception):
    """The rendezvous could not complete; the message says what it waited for."""


class RendezvousClosedError(RendezvousError):
    """The job this node tried to join has already finished."""


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete within ``join_timeout``."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous store could not be reached (or hosted), or was lost."""


class RendezvousStateError(RendezvousError):
    """The rendezvous store holds a state no relaunch wrote (``BadStoreValue`` is one)."""


class RendezvousGracefulExitError(RendezvousError):
    """torch's: a node left out of a closed rendezvous exits without failing. relaunch ends such
    a node with ``RendezvousClosedError`` (the agent and the launcher take it as a clean end);
    the class is here for code that catches torch's."""


class JobFailedError(RendezvousError):
    """The job ended while this node's workers ran: another node failed with no restart left
    (the message says why), or the job was closed while this node re-formed. ``requeue``
    False: that node stopped the job for a failure that running it again cannot mend."""

    def __init__(self, message: str, requeue: bool = True) -> None:
        super().__init__(message)
        self.requeue = requeue


class StoreHostGone(RendezvousError):
    """The built-in store's host (another node's agent) is gone, and the store with it: the job
    cannot go on, and the message says what to do."""


class AgentFault(RendezvousError):
    """The agent cannot go on, and its job cannot either: a helper thread failed, or the store
    holds a value no relaunch wrote. The agent ends the job (``fail_job``) and says why in one
    line."""


class BadStoreValue(AgentFault, RendezvousStateError, ExplainedError):
    """A value read from the rendezvous store is not what relaunch writes there; the message
    names the key."""

    def __init__(self, key: str, raw: bytes | None, why: object) -> None:
        self.key = key
        shown = (raw or b"")[:40].decode("utf-8", errors="replace")
        more = "..." if raw is not None and len(raw) > 40 else ""
        why_text = " ".join(str(why).split())
        super().__init__(
            f"the rendezvous store holds a bad value under {key} ({shown!r}{more}): {why_text}; "
            "something other than relaunch wrote there (another job with this --rdzv-id?)"
        )


def store_int(key: str, raw: bytes | None, default: int = 0, digits: int = 32) -> int:
    """The integer stored under ``key`` (``default`` when absent), of at most ``digits``
    digits; ``BadStoreValue`` if it is not one."""
    if raw is None or raw == b"":
        return default
    try:
        if len(raw) > digits:
            raise ValueError("too long for a count")
        return int(raw)
    except ValueError:
        raise BadStoreValue(key, raw, "not an integer") from None


def store_change(key: str, raw: bytes) -> tuple[MembershipChange, int | None]:
    """The ``changed`` record stored under ``key`` (``core.rendezvous.membership.decode_change``);
    ``BadStoreValue`` if no relaunch wrote it."""
    try:
        return decode_change(raw)
    except ValueError as exc:
        raise BadStoreValue(key, raw, exc) from None


def store_record(key: str, raw: bytes | None) -> NodeRecord:
    """The node record stored under ``key`` (``core.run.exclusion.decode_record``; absent: clean);
    ``BadStoreValue`` if no relaunch wrote it."""
    try:
        return decode_record(raw)
    except ValueError as exc:
        raise BadStoreValue(key, raw, exc) from None


@dataclass(init=False, repr=False, eq=False)  # dataclass's would be compiled at import
class RendezvousParameters(DataclassMethods):
    """What a handler is built from: the CLI's ``--rdzv-*`` flags and ``--rdzv-conf`` pairs."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **config: Any,
    ) -> None:
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config = config

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """``key``'s value as a bool (torch's spellings: 1/0, true/false, t/f, yes/no, y/n, any
        case); ValueError naming the key for anything else."""
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        text = str(value).strip().lower() if isinstance(value, (str, int)) else ""
        if text in ("1", "true", "t", "yes", "y"):
            return True
        if text in ("0", "false", "f", "no", "n"):
            return False
        raise ValueError(
            f"rendezvous option {key}={value!r}: expected a boolean (true/false, 1/0, yes/no)"
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """``key``'s value as an int; ValueError naming the key when it is not one."""
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"rendezvous option {key}={value!r}: expected an integer") from None

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, "
            f"max_nodes={self.max_nodes}, local_addr={self.local_addr!r}, "
            f"config={redacted(self.config)!r})"
        )


class RendezvousHandler(abc.ABC):
    """One node's side of the rendezvous: torch's handler methods, no more. What the nodes of a
    job share beyond joining (the restart budget, notes, the membership change) is the job's
    (``rendezvous.job.JobServices``), which a handler may offer as its ``job``."""

    @abc.abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and return this node's place in it."""

    @abc.abstractmethod
    def get_backend(self) -> str: ...

    @abc.abstractmethod
    def get_run_id(self) -> str: ...

    @property
    def use_agent_store(self) -> bool:
        """Whether the workers use the agent's store (torch's ``TORCHELASTIC_USE_AGENT_STORE``);
        relaunch's workers never do."""
        return False

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join a running job (a reason to restart into a larger round)."""
        return 0

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:  # noqa: B027 - nothing to close for fixed membership
        """Mark the job finished, so nodes arriving late exit cleanly."""

    def shutdown(self) -> bool:
        return True


#: What builds a handler for a backend from its parameters (torch's name).
RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]


class RendezvousHandlerRegistry:
    """Backends by name, each with the creator that builds its handler: where a user's own
    backend plugs into ``get_rendezvous_handler`` (``rendezvous_handler_registry``, as in
    torch). relaunch's built-in backends are registered by ``rendezvous.backends``."""

    def __init__(self) -> None:
        self._registry: dict[str, RendezvousHandlerCreator] = {}

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Make ``creator`` build the handlers of ``backend``; ValueError for an empty name, or
        for a name another creator has."""
        if not backend:
            raise ValueError("a rendezvous backend needs a name: got an empty one")
        current = self._registry.get(backend)
        if current is not None and current != creator:
            raise ValueError(
                f"rendezvous backend {backend!r} is already registered (with {current!r}): "
                "give yours another name"
            )
        self._registry[backend] = creator

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """The handler ``params.backend``'s creator builds; ValueError naming the registered
        backends for an unknown one, RuntimeError when the handler says it is another's."""
        creator = self._registry.get(params.backend)
        if creator is None:
            raise ValueError(
                f"unknown rendezvous backend {params.backend!r}: valid backends are "
                + ", ".join(self._registry)
                + "; register another with rendezvous_handler_registry.register(name, creator)"
            )
        handler = creator(params)
        if handler.get_backend() != params.backend:
            raise RuntimeError(
                f"the creator of rendezvous backend {params.backend!r} built a handler of "
                f"backend {handler.get_backend()!r}"
            )
        return handler


#: The registry ``get_rendezvous_handler`` builds handlers from.
rendezvous_handler_registry = RendezvousHandlerRegistry()
