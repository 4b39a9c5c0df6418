"""The rendezvous handler interface the agent drives (``backends`` builds one by name).

This module imports no handler, so every handler can import it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relaunch.core.exclusion import NodeRecord, decode_record
from relaunch.core.membership import MembershipChange, decode_change
from relaunch.core.rdzv_conf import redacted
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

#: The environment variable that holds the rendezvous store's shared token.
TOKEN_ENV = "RELAUNCH_RDZV_TOKEN"


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
    (the message says why), or the job was closed while this node re-formed."""


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
    """The ``changed`` record stored under ``key`` (``core.membership.decode_change``);
    ``BadStoreValue`` if no relaunch wrote it."""
    try:
        return decode_change(raw)
    except ValueError as exc:
        raise BadStoreValue(key, raw, exc) from None


def store_record(key: str, raw: bytes | None) -> NodeRecord:
    """The node record stored under ``key`` (``core.exclusion.decode_record``; absent: clean);
    ``BadStoreValue`` if no relaunch wrote it."""
    try:
        return decode_record(raw)
    except ValueError as exc:
        raise BadStoreValue(key, raw, exc) from None


@dataclass
class RendezvousStoreInfo:
    """Where the workers find their store: ``MASTER_ADDR`` and ``MASTER_PORT`` (torch 2.13's
    ``RendezvousStoreInfo``)."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"
    master_addr: str
    master_port: int

    @staticmethod
    def build(
        rank: int, store: Any, local_addr: str | None, server_port: int | None = None
    ) -> RendezvousStoreInfo:
        """The node of ``rank`` 0 publishes its address (``local_addr``, else its name) and
        ``server_port`` (else a free port) in ``store``; every node reads them from there.
        ``store``: torch's ``Store`` or relaunch's (``rendezvous.any_store``)."""
        from relaunch.rendezvous.any_store import AnyStore

        shared = AnyStore(store)
        keys = (RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY)
        if rank == 0:
            import socket

            from relaunch.endpoints import find_free_port

            addr = local_addr or socket.getfqdn()
            port = server_port or find_free_port(addr)
            shared.set_many(zip(keys, (addr.encode(), str(port).encode()), strict=True))
        addr_raw, port_raw = shared.get_many(keys)
        return RendezvousStoreInfo(addr_raw.decode(), int(port_raw))


class RendezvousInfo:
    """The outcome of one rendezvous round, for this node.

    torch 2.13's shape: ``RendezvousInfo(store, rank, world_size, bootstrap_store_info)``, where
    ``rank`` and ``world_size`` count nodes (also named ``group_rank`` and
    ``group_world_size``) and ``bootstrap_store_info`` says where the workers' store is (also
    ``master_addr`` and ``master_port``). relaunch's handlers also say where this node's
    workers stand (keyword-only): ``rank_offset``, the global rank of its first worker, and
    ``global_world_size``, the workers of all nodes; ``role_rank_offset`` and
    ``role_world_size``, the same within the node's role. Without them (a handler written for
    torch) the agent works them out as torch's does, through ``store``.
    """

    #: The fields in constructor order (store first), for equality and the repr.
    _FIELDS = (
        "_store",
        "_rank",
        "_world_size",
        "_master",
        "_rank_offset",
        "_global_world_size",
        "_role_rank_offset",
        "_role_world_size",
    )
    __slots__ = _FIELDS

    def __init__(
        self,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        bootstrap_store_info: RendezvousStoreInfo | None = None,
        *,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        rank_offset: int | None = None,
        global_world_size: int | None = None,
        role_rank_offset: int | None = None,
        role_world_size: int | None = None,
    ) -> None:
        self._store = store
        self._rank = _one_of("rank", rank, "group_rank", group_rank)
        self._world_size = _one_of("world_size", world_size, "group_world_size", group_world_size)
        if bootstrap_store_info is not None and (master_addr, master_port) != (None, None):
            raise TypeError(
                "RendezvousInfo takes bootstrap_store_info or master_addr/master_port, not both"
            )
        if bootstrap_store_info is None and master_addr is not None:
            bootstrap_store_info = RendezvousStoreInfo(master_addr, master_port or 0)
        self._master = bootstrap_store_info
        if (rank_offset is None) != (global_world_size is None):
            raise TypeError("RendezvousInfo takes rank_offset and global_world_size together")
        if (role_rank_offset is None) != (role_world_size is None) or (
            role_rank_offset is not None and rank_offset is None
        ):
            raise TypeError(
                "RendezvousInfo takes role_rank_offset and role_world_size together, and with "
                "rank_offset and global_world_size"
            )
        self._rank_offset = rank_offset
        self._global_world_size = global_world_size
        self._role_rank_offset = role_rank_offset
        self._role_world_size = role_world_size

    @property
    def store(self) -> Any:
        """The store the agents of the job share (torch's control-plane store)."""
        return self._store

    @property
    def rank(self) -> int:
        """This node's rank among the nodes (its group rank)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of nodes (the group world size)."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Where the workers' store is: MASTER_ADDR and MASTER_PORT (None: not said)."""
        return self._master

    group_rank = rank
    group_world_size = world_size

    @property
    def master_addr(self) -> str | None:
        return None if self._master is None else self._master.master_addr

    @property
    def master_port(self) -> int | None:
        return None if self._master is None else self._master.master_port

    @property
    def rank_offset(self) -> int | None:
        """The global rank of this node's first worker (None: the handler did not say)."""
        return self._rank_offset

    @property
    def global_world_size(self) -> int | None:
        """The number of workers of all nodes (None: the handler did not say)."""
        return self._global_world_size

    @property
    def role_rank_offset(self) -> int | None:
        """The role rank of this node's first worker (None: as ``rank_offset``, one role)."""
        return self._role_rank_offset

    @property
    def role_world_size(self) -> int | None:
        """The workers of this node's role (None: as ``global_world_size``, one role)."""
        return self._role_world_size

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RendezvousInfo) and self._fields() == other._fields()

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{name.lstrip('_')}={value!r}"
            for name, value in zip(self._FIELDS, self._fields(), strict=True)
            if name != "_store" and value is not None
        )
        return f"RendezvousInfo({shown})"


def _one_of(name: str, value: int | None, alias: str, aliased: int | None) -> int:
    """The value given as ``name`` or as its ``alias`` (the same, if both); TypeError when
    neither is given or they differ."""
    if value is None and aliased is None:
        raise TypeError(f"RendezvousInfo needs {name} (or {alias})")
    if value is not None and aliased is not None and value != aliased:
        raise TypeError(f"RendezvousInfo got {name}={value} and {alias}={aliased}: give one")
    result = value if value is not None else aliased
    assert result is not None
    return result


@dataclass
class RendezvousParameters:
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
