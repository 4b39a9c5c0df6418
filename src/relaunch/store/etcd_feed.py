"""What a node follows on etcd: one streaming watch over a prefix, held for the node's life, and
what it saw there, served from memory (``get``, ``watch``) or handed to subscribers as it comes
(``subscribe``).

Why: every member of a round waits for the same few keys (the round's final record, its round
signal, the job's ``closed``). A watch per key and round costs a connection and a gRPC stream, and
one started from an earlier revision waits for etcd's catching-up loop (512 watchers each 100 ms);
at a thousand nodes re-forming, those creations crowded out the events they waited for. One stream a
node, opened before the node first joins, sees every later write under the prefix as it happens, and
a wait costs no request at all.

What it saw is complete for the keys written after ``start()`` returned: a caller waits only for
keys written after an earlier write of its own (a round's final record after the node's join; its
round signal after its final record). An idle stream is checked each ``idle`` seconds with one read,
and opened again, on another member if need be, from the last revision it delivered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from relaunch.core.durations import seconds
from relaunch.runtime import SYSTEM_CLOCK, Clock, report_failure, start_thread
from relaunch.store.api import StoreConnectionError, StoreError, Versioned
from relaunch.store.etcd import EtcdStore
from relaunch.store.etcd_gateway import WatchStream
from relaunch.store.etcd_shapes import event_value, key_of, prefix_end
from relaunch.store.retry import Backoff

ABSENT = Versioned(None, 0)
#: What a subscriber gives: the call for each change of its key, and the one if the feed breaks.
Subscription = tuple[Callable[[Versioned], None], Callable[[StoreError], None]]

log = logging.getLogger(__name__)


class PrefixFeed:
    """Every write under ``prefix`` on ``store`` (a store of its own: one thread reads it) from
    ``start()`` on; ``idle``: seconds of silence after which the stream's member is checked.
    Waits keep their deadlines on ``clock``."""

    def __init__(
        self, store: EtcdStore, prefix: str, idle: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self._store, self._prefix, self._idle = store, prefix, idle
        self._clock = clock
        self._seen: dict[str, Versioned] = {}
        self._revision = 0  # every event up to this revision is in _seen
        self._error: StoreError | None = None
        self._changed = threading.Condition()
        self._subscribers: dict[str, list[Subscription]] = {}
        self._stream: WatchStream | None = None
        self._results: Iterator[dict[str, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        """Open the watch (the first call only): from the return on, every write under the
        prefix is seen. ``StoreError`` when no member takes it within the store's timeout."""
        if self._thread is None:
            self._open(0)
            self._thread = start_thread(self._follow, "relaunch-etcd-feed")

    def get(self, key: str) -> Versioned:
        """``key`` as last seen written (absent if it was not, since ``start()``)."""
        with self._changed:
            self._raise_if_broken()
            return self._seen.get(key, ABSENT)

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        """``key`` once its version differs from ``version``, or as it is after ``timeout``."""
        deadline = self._clock.monotonic() + timeout
        with self._changed:
            while True:
                self._raise_if_broken()
                current = self._seen.get(key, ABSENT)
                left = deadline - self._clock.monotonic()
                if current.version != version or left <= 0:
                    return current
                self._changed.wait(left)

    def subscribe(
        self, key: str, heard: Callable[[Versioned], None], lost: Callable[[StoreError], None]
    ) -> Callable[[], None]:
        """Call ``heard`` with ``key`` whenever it is written or deleted, on the feed's thread
        (a caller's thread needs no wake-up), and at once if it was written already; ``lost``
        when the feed breaks. Returns what ends the subscription."""
        subscription = (heard, lost)
        with self._changed:
            self._subscribers.setdefault(key, []).append(subscription)
            current, error = self._seen.get(key), self._error
        if error is not None:
            lost(StoreConnectionError(str(error)))
        elif current is not None:
            heard(current)

        def unsubscribe() -> None:
            with self._changed:
                listeners = self._subscribers.get(key, [])
                if subscription in listeners:
                    listeners.remove(subscription)
                if not listeners:
                    self._subscribers.pop(key, None)

        return unsubscribe

    def forget(self, prefix: str) -> None:
        """Drop what was seen under ``prefix`` (keys nobody will wait for again)."""
        with self._changed:
            for key in [k for k in self._seen if k.startswith(prefix)]:
                del self._seen[key]

    def close(self) -> None:
        """Stop following (the thread ends with its stream)."""
        self._closed = True
        stream = self._stream
        if stream is not None:
            stream.interrupt()

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise StoreConnectionError(str(self._error))

    def _open(self, start_revision: int) -> None:
        """Open the stream from ``start_revision`` (0: from now) on some member, within the
        store's timeout, and read its first result (created)."""
        backoff = Backoff(self._clock.monotonic() + self._store.timeout, self._clock)
        while not self._closed:
            stream = self._store.open_watch(
                self._prefix, prefix_end(self._prefix), start_revision, self._idle
            )
            if stream is not None:
                results = stream.results()
                created = next(results, None)
                if created is not None and created.get("created"):
                    if not start_revision:
                        self._revision = int(created["header"]["revision"])
                    self._stream, self._results = stream, results
                    return
                stream.close()
                if stream.compacted:
                    start_revision = self._resync() + 1
                    continue
            if not backoff.pause():
                raise StoreConnectionError(
                    f"cannot watch {self._prefix!r} on etcd at {self._store.describe()} "
                    f"within {seconds(self._store.timeout)}"
                )

    def _resync(self) -> int:
        """Events were compacted away: read the prefix whole, and tell the subscribers of the
        keys that changed meanwhile; the revision read at."""
        keys, revision = self._store.read_prefix(self._prefix)
        with self._changed:
            seen = self._seen
            changes = [
                (key, keys.get(key, ABSENT))
                for key in set(keys) | set(seen)
                if keys.get(key, ABSENT) != seen.get(key, ABSENT)
            ]
        self._apply(changes, revision)
        return revision

    def _follow(self) -> None:
        """Follow the stream (``_follow_stream``). Should following fail other than by losing
        etcd (a reply of the wrong shape, a bug), the waiters hear it as a broken feed, and the
        failure goes on to the agent (``runtime.start_thread``): never a silent death."""
        try:
            self._follow_stream()
        except BaseException as exc:
            if not self._closed:
                self._break(StoreConnectionError(f"the etcd feed failed: {exc}"))
            raise

    def _break(self, exc: StoreError) -> None:
        """The feed ends with ``exc``: wake the waiters and tell the subscribers."""
        with self._changed:
            if self._error is not None:
                return
            self._error = exc
            self._changed.notify_all()
            subscribers = [s for subs in self._subscribers.values() for s in subs]
        for _, lost in subscribers:
            _call(lost, exc)

    def _follow_stream(self) -> None:
        """Take the stream's events; when it breaks, open it again from where it stopped."""
        while not self._closed:
            stream, results = self._stream, self._results
            assert stream is not None and results is not None
            for result in results:
                if result is None:  # silence: check that its member still answers
                    if not self._member_answers(stream):
                        break
                    continue
                self._take(result.get("events", ()))
            stream.close()
            if self._closed:
                return
            try:
                if stream.compacted:
                    self._resync()
                self._open(self._revision + 1)
            except StoreError as exc:
                self._break(exc)
                return

    def _member_answers(self, stream: WatchStream) -> bool:
        """Whether the stream's member still serves this store (one read)."""
        try:
            self._store.get(self._prefix)
        except StoreError:
            return False
        return self._store.member == stream.endpoint

    def _take(self, events: list[dict[str, Any]]) -> None:
        """The stream's events, in their order."""
        changes: list[tuple[str, Versioned]] = []
        revision = 0
        for event in events:
            kv = event["kv"]
            revision = max(revision, int(kv.get("mod_revision", 0)))
            changes.append((key_of(kv), event_value(event)))
        if changes:
            self._apply(changes, revision)

    def _apply(self, changes: list[tuple[str, Versioned]], revision: int) -> None:
        """Note ``changes`` (an absent value: deleted), seen up to ``revision``; wake the
        waiters, then call the subscribers, outside the lock (a subscriber may call the feed)."""
        heard: list[tuple[Callable[[Versioned], None], Versioned]] = []
        with self._changed:
            for key, value in changes:
                if value.value is None:
                    self._seen.pop(key, None)
                else:
                    self._seen[key] = value
                heard += [(listener, value) for listener, _ in self._subscribers.get(key, ())]
            self._revision = max(self._revision, revision)
            self._changed.notify_all()
        for listener, value in heard:
            _call(listener, value)


def _call(listener: Callable[[Any], None], argument: Any) -> None:
    """Call a subscriber; its failure must not stop the feed, nor go unheard: it is reported as
    the feed thread's (``runtime.report_failure``), which ends the agent with one line."""
    try:
        listener(argument)
    except Exception as exc:
        report_failure("relaunch-etcd-feed", exc)
