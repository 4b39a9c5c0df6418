"""The built-in store's kind, and the in-process store's (see kinds): atomic counters.

Joins and tallies are counters (roster.CounterRoster), heartbeats a counter each member
bumps (CounterPulse), a change and its round signal two writes, and waits go to the store itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from relaunch.core.durations import seconds
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.rounds import KeyOf
from relaunch.rendezvous.heartbeat import Silence
from relaunch.rendezvous.kinds import Pulse, read_each
from relaunch.rendezvous.roster import CounterRoster, Roster
from relaunch.rendezvous.rounds import CLOSED
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import Store, Watchable

if TYPE_CHECKING:
    from relaunch.store.etcd_feed import PrefixFeed


def supersede_on_counters(store: Store, changed: str, round_signal: str, record: bytes) -> bool:
    """``StoreKind.supersede`` on the built-in store: the change, then its round signal."""
    won = store.compare_set(changed, 0, record).succeeded
    if won:
        store.set(round_signal, record)
    return won


class CounterKind:
    """The built-in store (and the in-process one): joins and tallies as atomic counters,
    heartbeats as counters, waits on the store itself. ``heartbeat_store`` defaults to
    ``store``; without a ``watch_store`` the heartbeat looks for re-forms each beat."""

    feed: PrefixFeed | None = None

    def __init__(
        self,
        store: Store,
        heartbeat_store: Store | None = None,
        watch_store: Store | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.heartbeat_store = heartbeat_store or store
        self.watch_store = watch_store
        self._clock = clock

    @property
    def news(self) -> Watchable:
        return self.store

    def roster(self, key: KeyOf, node_id: str) -> Roster:
        return CounterRoster(self.store, key, self._clock)

    def answers(self, key: KeyOf, node_id: str) -> Roster:
        return CounterRoster(self.watch_store or self.heartbeat_store, key, self._clock)

    def supersede(self, changed: str, round_signal: str, record: bytes) -> bool:
        return supersede_on_counters(self.store, changed, round_signal, record)

    def read_notes(self, prefix: str, names: Sequence[str]) -> Iterator[tuple[str, bytes]]:
        return read_each(self.store, prefix, names)

    def pulse(self, settings: plan.Settings, since: float) -> Pulse:
        return CounterPulse(self.heartbeat_store, settings, since)

    @staticmethod
    def lost_node_grace(settings: plan.Settings) -> float:
        """The neighbour's silence counts from its last beat seen, checked once a beat."""
        return settings.dead_after + settings.keep_alive_interval

    def close_job(
        self,
        key: KeyOf,
        next_round: int,
        join_timeout: float,
        mark_finished: Callable[[], None],
        record: bytes,
    ) -> None:
        self.store.set(key("closed", None), record)
        mark_finished()
        # Wake and dismiss anyone waiting to join the next round.
        self.store.compare_set(key("final", next_round), 0, CLOSED)

    def release(self) -> None:
        pass  # a counter keeps nothing alive


class CounterPulse:
    """Heartbeats as a counter each member bumps; a neighbour whose counter stands still, over
    ``dead_after`` seconds during which the judge could reach the store, died."""

    def __init__(self, store: Store, settings: plan.Settings, since: float) -> None:
        self._store, self._settings = store, settings
        self._since = since  # when every member's first beat is due
        self._seen: dict[str, int] = {}
        self._silence = Silence(settings)

    def beat(self, key: str) -> None:
        self._store.add(key, 1)

    def lost(self, key: str, now: float) -> str | None:
        """Why the member beating at ``key`` counts as dead, or None while it lives."""
        covered = self._silence.tick(now)
        if now < self._since:
            return None
        version = self._store.get(key).version
        if self._seen.get(key) != version:
            self._seen[key] = version
            self._silence.heard(key)
            return None
        if self._silence.silent(key, covered) > self._settings.dead_after:
            return f"no heartbeat for {seconds(self._settings.dead_after)}"
        return None
