"""Watching a running round: this member's heartbeat, its ring neighbour's, and the round's
``changed`` record (heard through its bell, ``rollcall``). Whatever they notice goes to one
callback, as a ``MembershipChange``; a roll call is answered on the spot.

Each member watches one neighbour, so a round of N nodes costs O(1) store operations per node
and beat. Two ways to beat (a ``Pulse``, the store kind's: ``kinds``): a counter the member
bumps (the built-in store), or an etcd lease holding the member's key, which etcd deletes when
the member stops renewing it.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from relaunch.core import rendezvous as plan
from relaunch.core.durations import seconds
from relaunch.core.membership import MembershipChange
from relaunch.rendezvous.api import store_change
from relaunch.rendezvous.rollcall import CALL
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread
from relaunch.store.api import Store, StoreError, Versioned, Watchable

if TYPE_CHECKING:
    from relaunch.rendezvous.kinds import StoreKind
    from relaunch.store.etcd import EtcdStore


class Pulse(Protocol):
    """One way to beat, for one round: this member's beat, and the verdict on a neighbour's."""

    def beat(self, key: str) -> None:
        """Beat once, at ``key`` (this member's heartbeat key of the round)."""

    def lost(self, key: str, now: float) -> str | None:
        """Why the member beating at ``key`` counts as dead at ``now``, or None while it
        lives."""


class RoundWatch:
    """The threads that watch one round for the member of group rank ``group_rank`` of
    ``count``.

    ``round_key`` names a key of the round (``"changed"``, ``"hb/3"``). The heartbeat goes
    through the ``stores``' heartbeat connection, beating their kind's way. A re-form or a roll
    call reaches this member at once through the round's bell: on etcd the node's feed of the
    job's news calls it back; else, with a watch connection, a second thread blocks on the
    bell; without either the heartbeat looks at ``changed`` and ``call`` each beat. ``answer``
    answers a roll call (once a round). Beats are timed on ``clock``.
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
            self._unsubscribe = self._feed.subscribe(self._key("bell"), self._rung, self._lost)
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

    def _rung(self, rung: Versioned) -> None:
        """The bell, as the feed heard it: answer a roll call; note a change (etcd writes a
        change and its ring at once, but a roll call may have rung over it since)."""
        feed = self._feed
        assert feed is not None
        if self._stop.is_set():
            return
        try:
            if rung.value == CALL:
                self._answer_call(feed, called=True)
            key, record = self._key("bell"), rung.value
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
        """Block on this round's bell: a re-form anywhere, or a roll call, reaches us at once.
        Each keep-alive interval, look at ``changed`` anyway, in case whoever wrote it died
        before ringing."""
        store = self._watch_store
        assert store is not None
        bell, stop, version = self._key("bell"), self._stop, 0
        interval = self._settings.keep_alive_interval
        try:
            rung = store.watch(bell, version, interval)
            while not stop.is_set():
                version = rung.version
                if rung.value == CALL:
                    self._answer_call(store, called=True)
                key, record = bell, rung.value
                if record is None or record == CALL:
                    key = self._key("changed")
                    record = store.get(key).value
                if record is not None:
                    self._flag(store_change(key, record)[0], True)
                    return
                rung = store.watch(bell, version, interval)
        except StoreError as exc:
            if not stop.is_set():
                self._flag(MembershipChange.store_lost(exc), False)

    def _answer_call(self, store: Watchable, called: bool) -> None:
        """Answer the round's roll call once, if it was called (``called``: the bell said so)."""
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
                if self._watch_store is None:  # nobody blocks on the bell: look each beat
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
                    return  # an etcd lease lives on into the next round (the handler revokes it)
        except StoreError as exc:
            if not stop.is_set():
                self._flag(MembershipChange.store_lost(exc), False)


#: A judge's check counts at most this many keep-alive intervals of a neighbour's silence: a
#: longer gap between two of its checks is time the judge itself could not reach the store (or
#: did not run), which says nothing about the neighbour (issue 24: a store outage, such as an
#: etcd leader election, is not a peer's death).
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


class NodeLease:
    """This node's etcd lease, kept from its first round to its shutdown: the heartbeat key of
    each round hangs on it. Keeping it across rounds saves a grant and a revoke per node and
    re-form, and a member re-forming never looks lost to a neighbour that has not yet heard."""

    def __init__(self, store: EtcdStore, ttl: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store, self._ttl, self._clock = store, ttl, clock
        self.id: int | None = None
        self._renewed_at = 0.0  # clock.monotonic() of the last grant or renewal

    def renew(self) -> bool:
        """Keep the lease alive; False when there is none, or it expired (its keys are gone)."""
        if self.id is not None and self._store.keep_alive(self.id):
            self._renewed_at = self._clock.monotonic()
            return True
        self.id = None
        return False

    def fresh(self) -> bool:
        """Whether the lease surely lives: renewed within half its time to live."""
        return self.id is not None and self._clock.monotonic() - self._renewed_at < self._ttl / 2

    def grant(self) -> int:
        if self.id is None:
            self.id = self._store.grant_lease(self._ttl)
            self._renewed_at = self._clock.monotonic()
        return self.id

    def revoke(self) -> None:
        """End it now: this node's keys go at once (shutting down)."""
        if self.id is not None:
            lease, self.id = self.id, None
            try:
                self._store.revoke_lease(lease)
            except StoreError:
                pass


class LeasePulse:
    """Heartbeats as the node's etcd lease, which it renews, holding the round's key: when the
    member dies, etcd lets the lease expire and deletes the key, which is how its neighbour
    learns it."""

    def __init__(
        self, store: EtcdStore, settings: plan.Settings, lease: NodeLease, since: float
    ) -> None:
        self._store, self._settings, self._lease = store, settings, lease
        self._held: str | None = None  # the key put on the lease
        self._started = since  # when every member's first beat is due
        self._seen: set[str] = set()
        self._silence = Silence(settings)

    def beat(self, key: str) -> None:
        if self._held == key:
            if self._lease.renew():
                return
        elif not self._lease.fresh():  # a re-form may have outlived it: nobody renews between
            self._lease.renew()
        self._store.set(key, b"", lease=self._lease.grant())
        self._held = key

    def lost(self, key: str, now: float) -> str | None:
        """etcd's verdict (the neighbour's lease expired, its key is gone) stands when this
        judge reached etcd throughout the last ``dead_after``; after an outage the judge saw
        too (a leader election: the neighbour's renewals may have been stuck like its own), the
        neighbour gets ``dead_after`` seconds of reachable time to put its key back."""
        covered = self._silence.tick(now)
        settings = self._settings
        if not self._seen and now - self._started < settings.keep_alive_interval:
            return None  # the first beat: the neighbour may not have beaten yet
        if self._store.get(key).value is not None:
            self._seen.add(key)
            self._silence.heard(key)
            return None
        silence = self._silence.silent(key, covered)
        steady = now - self._silence.stalled_at > settings.dead_after + settings.keep_alive_interval
        if key in self._seen and steady:
            return "its etcd lease expired"
        if silence > settings.dead_after and now - self._started > settings.dead_after:
            return f"no heartbeat for {seconds(settings.dead_after)}"
        return None
