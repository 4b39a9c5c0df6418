"""The rendezvous handler interface the agent drives (``backends`` builds one by name).

This module imports no handler, so every handler can import it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from relaunch.core.exclusion import NodeRecord, decode_record
from relaunch.core.membership import MembershipChange, decode_change
from relaunch.core.rdzv_conf import redacted
from relaunch.runtime import ExplainedError

#: The environment variable that holds the rendezvous store's shared token.
TOKEN_ENV = "RELAUNCH_RDZV_TOKEN"


class RendezvousError(Exception):
    """The rendezvous could not complete; the message says what it waited for."""


class RendezvousClosedError(RendezvousError):
    """The job this node tried to join has already finished."""


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


class BadStoreValue(AgentFault, ExplainedError):
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


def store_int(key: str, raw: bytes | None, default: int = 0) -> int:
    """The integer stored under ``key`` (``default`` when absent); ``BadStoreValue`` if it is
    not one."""
    if raw is None or raw == b"":
        return default
    try:
        if len(raw) > 32:
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


@dataclass(frozen=True)
class RendezvousInfo:
    """The outcome of one rendezvous round, for this node."""

    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    #: The global rank of this node's first worker, and the number of workers of all nodes.
    rank_offset: int
    world_size: int
    store: Any = None


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
