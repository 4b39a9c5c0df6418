"""Between built-in stores (docs/store-failover.md): a primary's stream to its standbys, a
standby following its primary, and the votes that promote a standby.

Only a store with a token serves a standby's stream (``REPLICATE``) or takes votes
(``PROMOTE``), since both trust the client with the job. A standby counts votes by itself: its
``Electorate``, read from its copy of the primary's keys, says who may vote and how many must
ask at once; a vote counts while its request waits.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass

import relaunch.store.wire as wire
from relaunch.runtime import start_thread
from relaunch.store.api import StoreError, StoreProtocolError
from relaunch.store.client import TcpStore
from relaunch.store.data import KeyValueData
from relaunch.store.operations import Client, Operations, Waiter, frame, key_of, seconds

log = logging.getLogger("relaunch.store.server")

#: A standby further behind than this is dropped (it follows again from a fresh snapshot).
REPLICA_HIGH_WATER = 64 << 20
#: What PROMOTE requests wait on (no client's key: they start with a NUL).
_PROMOTED = "\0promoted"


@dataclass(frozen=True, slots=True)
class Electorate:
    """Who may vote a standby into its primary's place (``voters``), and how many of them must
    ask at once (``quorum``)."""

    voters: Container[str]
    quorum: int


#: How a standby reads its ``Electorate`` from its copy of the primary's keys (``read(key)``:
#: the value, or None); None while nobody may vote.
Elect = Callable[[Callable[[str], "bytes | None"]], "Electorate | None"]


class Replication:
    """The standbys of a primary, or the primary a standby follows, over ``operations``.
    ``send`` and ``close`` act on a client (the loop's thread); ``wake`` wakes the loop
    (``weigh_votes`` then, on its thread); ``stopped`` is set when the server stops."""

    def __init__(
        self,
        operations: Operations,
        token: str | None,
        send: Callable[[Client, bytes], None],
        close: Callable[[Client], None],
        wake: Callable[[], None],
        now: Callable[[], float],
    ) -> None:
        self._operations, self._token = operations, token
        self._send, self._close, self._wake, self._now = send, close, wake, now
        self.replicas: set[Client] = set()
        self.primary: str | None = None  # a standby: the store it follows ("host:port")
        self.synced = False  # a standby holds a whole snapshot of its primary
        self._fresh = False  # its stream just began: the snapshot replaces what it held
        self.snapshots = 0
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # the follower's writes against the promotion
        self.follower: TcpStore | None = None
        self._elect: Elect | None = None  # a standby: who may vote it into the primary's place
        self._votes: dict[str, Waiter] = {}  # each voter's waiting PROMOTE request

    def _between_stores(self, what: str) -> None:
        """Only a store with a token serves standbys and takes votes: its clients proved it."""
        if self._token is None:
            raise StoreError(f"{what} needs a store with a token: this one has none")

    # -- a primary's side -------------------------------------------------------------------

    def replicate(self, client: Client, fields: list[bytes]) -> None:
        """The client is a standby: a snapshot now, then every change as it is made."""
        self._between_stores("following a store")
        client.replica = True
        self.replicas.add(client)
        state = self._operations.state
        for key, value, version in state.items():
            record = [wire.RECORD_KEY, key.encode(), value, wire.from_int(version)]
            self._send(client, frame(wire.OK, record))
        self._send(client, frame(wire.OK, [wire.RECORD_SYNCED, wire.from_int(state.revision)]))

    def ship(self, key: str) -> None:
        """Send the change just made to ``key`` to every standby; one too far behind is dropped."""
        if not self.replicas:
            return
        state = self._operations.state
        value, version = state.get(key)
        record = (
            [wire.RECORD_DELETED, key.encode(), wire.from_int(state.revision)]
            if value is None
            else [wire.RECORD_KEY, key.encode(), value, wire.from_int(version)]
        )
        shipped = frame(wire.OK, record)
        for replica in list(self.replicas):
            self._send(replica, shipped)
            if len(replica.out) > REPLICA_HIGH_WATER:
                log.warning("store: dropping the standby at %s: too far behind", replica.peer)
                self._close(replica)

    # -- a standby's side -------------------------------------------------------------------

    def follow(self, host: str, port: int, elect: Elect) -> None:
        """Follow the store at ``host:port`` (``TcpStoreServer.follow``)."""
        if self._token is None:
            raise ValueError("a standby needs the job's token: no primary serves a copy without")
        target = f"{host}:{port}"
        with self.lock:
            self._elect = elect
            if self.primary == target:
                return
            # Nothing from the old primary may be promoted: whole again with the new snapshot.
            self.primary, follower, self.synced = target, self.follower, False
        if follower is not None:
            follower.abort()
        start_thread(lambda: self._follow(host, port), "relaunch-store-standby")

    def _follow(self, host: str, port: int) -> None:
        target, pause = f"{host}:{port}", 0.05
        while self.primary == target and not self.stopped.is_set():
            try:
                store = TcpStore(host, port, self._token, timeout=30.0, connect_timeout=1.0)
            except StoreError:
                self.stopped.wait(pause)  # the primary is not there (yet, or any more)
                pause = min(2 * pause, 1.0)
                continue
            pause = 0.05
            with self.lock:
                if self.primary != target or self.stopped.is_set():
                    store.close()
                    return
                self.follower, self.synced, self._fresh = store, False, True
            try:
                store.replicate(functools.partial(self._apply, store))
            except StoreError as exc:
                log.debug("standby: lost the primary at %s:%d: %s", host, port, exc)
            finally:
                with self.lock:
                    if self.follower is store:
                        self.follower = None

    def _apply(self, stream: TcpStore, fields: list[bytes]) -> None:
        """One record of the primary's ``stream``, taken in (the follower's thread)."""
        with self.lock:
            if self.follower is not stream or self.stopped.is_set():
                raise StoreError("promoted, or following another store: this stream ends")
            kind = fields[0] if fields else b""
            if self._fresh:  # a new stream begins with a whole snapshot: start afresh
                self._operations.state, self._fresh = KeyValueData(), False
            state = self._operations.state
            if kind == wire.RECORD_KEY and len(fields) == 4:
                state.apply(key_of(fields[1]), fields[2], wire.to_int(fields[3]))
            elif kind == wire.RECORD_DELETED and len(fields) == 3:
                state.apply(key_of(fields[1]), None, wire.to_int(fields[2]))
            elif kind == wire.RECORD_SYNCED and len(fields) == 2:
                state.revision = max(state.revision, wire.to_int(fields[1]))
                self.synced = True
                self.snapshots += 1
                self._wake()  # votes that came before the snapshot count now
            else:
                raise StoreProtocolError("not a replication record")

    def abort(self) -> None:
        """End the stream from the primary (the server stops)."""
        self.stopped.set()
        follower = self.follower
        if follower is not None:
            follower.abort()

    # -- votes --------------------------------------------------------------------------------

    def promote_request(self, client: Client, fields: list[bytes]) -> None:
        """``voter`` asks this standby to take over; the answer waits until a quorum of its
        electorate asked at once (or its timeout). A primary answers at once."""
        self._between_stores("a vote")
        if len(fields) != 2:
            raise StoreError("a vote is a voter and a timeout")
        voter, timeout = key_of(fields[0]), seconds(fields[1])
        if self.primary is None:
            self._operations.reply(client, wire.OK)
            return
        waiter = Waiter(client, (_PROMOTED,), self._now() + timeout)
        self._votes[voter] = waiter
        self._operations.park(waiter)
        self.weigh_votes()

    def weigh_votes(self) -> None:
        """Take over once the snapshot is whole and a quorum of the electorate read from it
        asks at once. Votes that lapsed (timed out, or their voter left) are forgotten first;
        a voter outside the electorate counts for nothing, and neither does what it says."""
        if self.primary is None or not self._votes:
            return
        for voter, waiter in list(self._votes.items()):
            if waiter.client.waiter is not waiter:
                del self._votes[voter]
        if not self.synced or not self._votes or self._elect is None:
            return
        with self.lock:  # the follower's thread writes the copy
            electorate = self._elect(lambda key: self._operations.state.get(key).value)
        if electorate is None:
            return
        asking = sum(1 for voter in self._votes if voter in electorate.voters)
        if asking >= max(electorate.quorum, 1):
            self._promote(asking)

    def _promote(self, voters: int) -> None:
        """Take over, ``voters`` having asked: serve the job from the state followed so far
        (the loop's thread)."""
        with self.lock:
            follower, self.follower, self.primary = self.follower, None, None
        if follower is not None:
            follower.abort()
        log.warning("store: this standby serves the job now (%d voters asked)", voters)
        self._votes.clear()
        operations = self._operations
        for waiter in list(operations.waiters.get(_PROMOTED, {})):
            operations.unpark(waiter)
            operations.reply(waiter.client, wire.OK)
