"""What differs between the kinds of store the dynamic rendezvous runs on, said in one place.

One ``StoreKind`` per node holds the node's connections to the store and does, its kind's way,
the few things the kinds do differently:

- who joined a round, and the tallies (``roster``, ``answers``): counters on the built-in store,
  one key per node on etcd (``roster``);
- heartbeats (``pulse``): a counter each member bumps, or the node's etcd lease holding its key,
  which etcd deletes when the node stops renewing it; hence the bound on noticing a lost node
  (``lost_node_grace``), and a lease to give back on shutting down (``release``);
- marking a round re-formed and writing its round signal (``supersede``): two writes, or on etcd one
  transaction, which reaches each member's feed as one event;
- a round's notes (``read_notes``): one read each, or on etcd one range read for all;
- closing the job (``close_job``): records that dismiss late nodes, or on etcd the job's keys
  deleted and the dismissal left on a lease;
- the job's news (``news``, ``feed``): waited for on the store, or on etcd through one watch a
  node (``store.etcd_feed``).

``kinds_counter.CounterKind`` is the built-in store's and the in-process one's;
``kinds_etcd.EtcdKind`` is etcd's. Each kind's module also builds its handler, says a dead
agent's death notice and opens ``relaunch status``'s reader (``kind_registry``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.rounds import KeyOf
from relaunch.rendezvous.roster import Roster
from relaunch.store.api import Store, Watchable

if TYPE_CHECKING:
    from relaunch.store.etcd_feed import PrefixFeed


class Pulse(Protocol):
    """One way to beat, for one round: this member's beat, and the verdict on a neighbour's."""

    def beat(self, key: str) -> None:
        """Beat once, at ``key`` (this member's heartbeat key of the round)."""

    def lost(self, key: str, now: float) -> str | None:
        """Why the member beating at ``key`` counts as dead at ``now``, or None while it
        lives."""


class StoreKind(Protocol):
    """One node's connections to the rendezvous store, and what their kind does its own way."""

    @property
    def store(self) -> Store:
        """The connection of the handler's own requests: joins, records, notes."""

    @property
    def heartbeat_store(self) -> Store:
        """The heartbeat thread's connection."""

    @property
    def watch_store(self) -> Watchable | None:
        """A connection of its own that blocks on the round's signal (None: the heartbeat looks
        at the round each beat)."""

    @property
    def feed(self) -> PrefixFeed | None:
        """etcd: the one watch this node follows the job's news with (None elsewhere)."""

    @property
    def news(self) -> Watchable:
        """Where waits for the job's news go: the feed, or the store itself."""

    def roster(self, key: KeyOf, node_id: str) -> Roster:
        """Joins and tallies of node ``node_id`` on the requests' connection."""

    def answers(self, key: KeyOf, node_id: str) -> Roster:
        """The same on the watching connection, which answers presence checks."""

    def supersede(self, changed: str, round_signal: str, record: bytes) -> bool:
        """Write the change ``record`` at ``changed`` unless one is there, and write
        ``round_signal`` with it: whether this one was written."""

    def read_notes(self, prefix: str, names: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        """``(name, value)`` of those of ``names`` that are there under ``prefix``, as read."""

    def pulse(self, settings: plan.Settings, since: float) -> Pulse:
        """Heartbeats for one round, every member's first beat due at ``since``."""

    def lost_node_grace(self, settings: plan.Settings) -> float:
        """Seconds a lost node may take to be noticed."""

    def close_job(
        self,
        key: KeyOf,
        next_round: int,
        join_timeout: float,
        mark_finished: Callable[[], None],
        record: bytes,
    ) -> None:
        """Close the job: late nodes (those waiting for round ``next_round``) are dismissed and
        the members in the exit barrier hear it; ``mark_finished`` marks the running round
        finished, where this kind needs it (its records outlive the job). ``record`` is the
        ``closed`` key's value: the failure that ended the job (``closed_record``), if one
        did."""

    def release(self) -> None:
        """Shutting down: let go at once of what keeps this node's keys alive."""


class StoreSeat(Protocol):
    """Where the job's store is, for what runs beside the rendezvous on one node of the job
    (torchft's lighthouse, ``agent.lighthouse_nodes``): a connection of its own, and whether
    this node hosts the store now."""

    #: Whether a node hosts the store (the built-in store: what runs beside it runs on that
    #: node), or none does (etcd: a node takes a lease to run it).
    hosted: bool
    #: The address the other nodes reach this one at.
    local_addr: str
    #: Seconds a lease of this node's lasts (etcd): the rendezvous' detection time.
    lease_ttl: float

    def connect(self) -> Store:
        """A new connection to the job's store, which follows it where it moves."""

    def host_here(self) -> str | None:
        """The store's host address when this node hosts the store now; None when it does not
        (or no node does)."""

    def on_move(self, moved: Callable[[], None]) -> None:
        """Call ``moved()`` each time the store moved to another node."""

    def at_shutdown(self, ending: Callable[[], None]) -> None:
        """Call ``ending()`` when the rendezvous shuts down, before its store is let go (a
        store this node hosts ends with it, unless ``outlive`` was asked)."""

    @property
    def kept(self) -> bool:
        """Whether the store this node hosts serves on past the rendezvous' shutdown
        (``outlive``), until ``end_store``."""

    def outlive(self) -> None:
        """From now on, a store this node hosts as the rendezvous shuts down serves on, for
        the agents of the job's other replica groups, until ``end_store``."""

    def end_store(self, wait: bool, say: Callable[[str], None]) -> None:
        """End the store kept by ``outlive`` (nothing when none is); with ``wait``, first until
        the other agents left it, said in a line."""


class SeatShutdown:
    """The ``at_shutdown`` of a seat: what to call as the rendezvous shuts down (``end``); and
    for a seat whose store no node hosts, nothing to keep past it."""

    def __init__(self) -> None:
        self._ending: list[Callable[[], None]] = []

    def at_shutdown(self, ending: Callable[[], None]) -> None:
        self._ending.append(ending)

    def end(self) -> None:
        """Call each, once."""
        ending, self._ending = self._ending, []
        for each in ending:
            each()

    @property
    def kept(self) -> bool:
        return False

    def outlive(self) -> None:
        pass

    def end_store(self, wait: bool, say: Callable[[str], None]) -> None:
        pass


def read_each(store: Store, prefix: str, names: Sequence[str]) -> Iterator[tuple[str, bytes]]:
    """``(name, value)`` of those of ``names`` that are there under ``prefix``: one read each."""
    for name in names:
        value = store.get(f"{prefix}{name}").value
        if value is not None:
            yield name, value
