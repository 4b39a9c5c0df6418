"""The store kinds of the dynamic rendezvous, by ``--rdzv-backend`` name, as
``core.rendezvous.rdzv_conf.STORE_KINDS`` lists them (one line a kind).

A kind's module (``kinds_c10d``, ``kinds_etcd``) says, beside its ``kinds.StoreKind``, what
the launcher, the orphan guardian and ``relaunch status`` need of it (``KindModule``). It is
loaded only when its backend is asked for: etcd's client loads only for etcd.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from relaunch.core.rendezvous.rdzv_conf import STORE_KINDS, registered_kind

if TYPE_CHECKING:
    from relaunch.core.rendezvous.rdzv_conf import RendezvousSettings, RendezvousSpec
    from relaunch.rendezvous.api import RendezvousHandler
    from relaunch.rendezvous.reader import JobReader


class EndpointError(ValueError):
    """``--rdzv-endpoint`` is not one its kind reads."""


class KindModule(Protocol):
    """What a kind's module offers outside a node's handler."""

    #: What ``relaunch status`` suggests when the store cannot be read.
    UNREACHABLE_HINT: str

    def create_handler(self, params: RendezvousSpec) -> RendezvousHandler:
        """The node's handler for the job ``params`` names."""

    def write_death_notice(
        self,
        where: Mapping[str, Any],
        changed: str,
        round_signal: str,
        record: bytes,
        timeout: float,
    ) -> bool:
        """A dead agent's death notice: write ``record`` at ``changed`` unless a change is there,
        and write ``round_signal``, on the store ``where`` says (its ``"store"`` is the backend
        name); whether it was written."""

    def open_reader(
        self,
        endpoint: str,
        run_id: str,
        conf: RendezvousSettings,
        timeout: float,
        environ: Mapping[str, str],
    ) -> tuple[JobReader, str]:
        """A reader of job ``run_id`` on the store at ``endpoint`` (``relaunch status``), and
        the store's address in words; each request takes at most ``timeout`` seconds.
        ``EndpointError`` when ``endpoint`` is not one."""


def backend_names() -> tuple[str, ...]:
    """Every backend name of a store kind, in the registry's order (``STORE_KINDS``)."""
    return tuple(name for kind in STORE_KINDS for name in kind.names)


def kind_module(backend: str) -> KindModule:
    """The module of ``backend``'s kind; KeyError when no kind answers to that name."""
    kind = registered_kind(backend)
    if kind is None:
        raise KeyError(backend)
    return cast(KindModule, importlib.import_module(kind.module))
