"""What one rendezvous round gives a node: ``RendezvousInfo`` and where the workers' store is,
``RendezvousStoreInfo`` (torch 2.13's shapes; ``rendezvous.api`` names them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from relaunch.core.value import DataclassMethods

__all__ = ["RendezvousInfo", "RendezvousStoreInfo"]


@dataclass(repr=False, eq=False)  # DataclassMethods: not compiled at import
class RendezvousStoreInfo(DataclassMethods):
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
