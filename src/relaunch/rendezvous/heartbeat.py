"""Watching a running round: this member's heartbeat, its ring neighbour's, and the round's
``changed`` record (heard through its round signal, ``presence``). Whatever they notice goes to one
callback, as a ``MembershipChange``; a presence check is answered on the spot.

Each member watches one neighbour, so a round of N nodes costs O(1) store operations per node
and beat. How a member beats, and how a neighbour's silence is judged, is its store kind's
(``kinds.Pulse``); ``Silence`` counts that silence for every kind.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch.core.rendezvous import rounds as plan
from relaunch.core.rendezvous.membership import MembershipChange
from relaunch.rendezvous.api import store_change
from relaunch.rendezvous.presence import CALL
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread
from relaunch.store.api import StoreError, Versioned, Watchable

if TYPE_CHECKING:
    from relaunch.rendezvous.kinds import StoreKind


class RoundWatch:
    """The threads that watch one round for the member of group rank ``group_rank`` of
    ``count``.

    ``round_key`` names a key of the round (``"changed"``, ``"hb/3"``). The heartbeat goes through
    the ``stores``' heartbeat connection, beating their kind's way. A re-form or a presence check
    reaches this member at once through the round's signal: where the kind has a feed of the job's
    news, the feed calls it back; else, with a watch connection, a second thread blocks on the round
    signal; without either the heartbeat looks at ``changed`` and ``call`` each beat. ``answer``
    answers a presence check (once a round). Beats are timed on ``clock``.
    """

    def __init__(
        self,
        round_key: Callable[[str], str],
        group_rank: int,
        count: int,
        settings: plan.Settings,
        stores: StoreKind,
        flag: Callable[[MembershipChange, bool], None],
        answer: Callable[[], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._key = round_key
        self._group_rank, self._count = group_rank, count
        self._settings = settings
        self._stores = stores
        self._store, self._watch_store = stores.heartbeat_store, stores.watch_store
        self._flag = flag
        self._answer = answer
        self._clock = clock
        self._answered = False
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None
        self._feed = stores.feed
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        self._beating = start_thread(self._beat, "relaunch-heartbeat")
        if self._feed is not None:
            self._unsubscribe = self._feed.subscribe(
                self._key("bell"), self._on_round_signal, self._lost
            )
        elif self._watch_store is not None:
            start_thread(self._watch_changes, "relaunch-rdzv-watch")

    def stop(self) -> None:
        """Stop beating and wait for the heartbeat thread; the watching thread ends within a
        beat and reports nothing more."""
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._beating is not None:
            self._beating.join()

    def _on_round_signal(self, signalled: Versioned) -> None:
        """The round signal, as the feed heard it: answer a presence check; note a change (a feed's
        kind writes a change and its round signal at once, but a presence check may have written
        over it since)."""
        feed = self._feed
        assert feed is not None
        if self._stop.is_set():
            return
        try:
            if signalled.value == CALL:
                self._answer_call(feed, called=True)
            key, record = self._key("bell"), signalled.value
            if record == CALL:
                key = self._key("changed")
                record = feed.get(key).value
            if record is not None:
                self._flag(store_change(key, record)[0], True)
        except StoreError as exc:
            self._lost(exc)

    def _lost(self, exc: StoreError) -> None:
        if not self._stop.is_set():
            self._flag(MembershipChange.store_lost(exc), False)

    def _watch_changes(self) -> None:
        """Block on this round's signal: a re-form anywhere, or a presence check, reaches us at
        once. Each keep-alive interval, look at ``changed`` anyway, in case whoever wrote it died
        before ringing."""
        store = self._watch_store
        assert store is not None
        round_signal, stop, version = self._key("bell"), self._stop, 0
        interval = self._settings.keep_alive_interval
        try:
            signalled = store.watch(round_signal, version, interval)
            while not stop.is_set():
                version = signalled.version
                if signalled.value == CALL:
                    self._answer_call(store, called=True)
                key, record = round_signal, signalled.value
                if record is None or record == CALL:
                    key = self._key("changed")
                    record = store.get(key).value
                if record is not None:
                    self._flag(store_change(key, record)[0], True)
                    return
                signalled = store.watch(round_signal, version, interval)
        except StoreError as exc:
            if not stop.is_set():
                self._flag(MembershipChange.store_lost(exc), False)

    def _answer_call(self, store: Watchable, called: bool) -> None:
        """Answer the round's presence check once, if it was called (``called``: the round signal
        said so)."""
        if self._answer is None or self._answered:
            return
        if called or store.get(self._key("call")).value is not None:
            self._answered = True
            self._answer()

    def _beat(self) -> None:
        """Heartbeat, watch one neighbour, and notice re-forming or waiting nodes: O(1) a beat."""
        store, settings, stop = self._store, self._settings, self._stop
        # A round's first beats spread over half an interval: a thousand members starting a
        # round at once would otherwise write a thousand heartbeats while the round's final
        # record is still on its way to the others. Neighbours are judged from then on.
        spread = settings.keep_alive_interval / 2
        pulse = self._stores.pulse(settings, self._clock.monotonic() + spread)
        neighbour = plan.ring_neighbour(self._group_rank, self._count)
        if stop.wait(random.uniform(0.0, spread)):
            return
        try:
            while True:
                pulse.beat(self._key(f"hb/{self._group_rank}"))
                if self._watch_store is None:  # nobody blocks on the round signal: look each beat
                    self._answer_call(store, called=False)
                    key = self._key("changed")
                    changed = store.get(key).value
                    if changed is not None:
                        self._flag(store_change(key, changed)[0], True)
                if neighbour is not None:
                    lost = pulse.lost(self._key(f"hb/{neighbour}"), self._clock.monotonic())
                    if lost:
                        self._flag(
                            MembershipChange.member_lost(neighbour, lost, self._group_rank),
                            False,
                        )
                if stop.wait(settings.keep_alive_interval):
                    return  # a lease lives on into the next round (the handler releases it)
        except StoreError as exc:
            if not stop.is_set():
                self._flag(MembershipChange.store_lost(exc), False)


#: A judge's check counts at most this many keep-alive intervals of a neighbour's silence: a
#: longer gap between two of its checks is time the judge itself could not reach the store (or
#: did not run), which says nothing about the neighbour (issue 24: a store outage, such as a
#: leader election of the store's cluster, is not a peer's death).
MAX_INTERVALS_A_CHECK = 1.5


class Silence:
    """How long each neighbour has been silent, counted only over time during which the judge
    could reach the store: each check adds the time since the judge's last one, capped at
    ``MAX_INTERVALS_A_CHECK`` keep-alive intervals."""

    def __init__(self, settings: plan.Settings) -> None:
        self._cap = settings.keep_alive_interval * MAX_INTERVALS_A_CHECK
        self._checked_at: float | None = None
        self.stalled_at = -math.inf  # when the judge last went a long while without a check
        self._silent: dict[str, float] = {}

    def tick(self, now: float) -> float:
        """A check at ``now``: the reachable time it covers."""
        gap = 0.0 if self._checked_at is None else max(0.0, now - self._checked_at)
        self._checked_at = now
        if gap > self._cap:
            self.stalled_at = now
        return min(gap, self._cap)

    def heard(self, key: str) -> None:
        self._silent.pop(key, None)

    def silent(self, key: str, covered: float) -> float:
        """``key`` said nothing over ``covered`` more seconds: its silence so far."""
        silence = self._silent.get(key, 0.0) + covered
        self._silent[key] = silence
        return silence
