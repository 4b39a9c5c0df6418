"""A ``Store`` on an etcd v3 cluster, spoken through etcd's gRPC-JSON gateway with the stdlib.

Why the gateway and not a client library: the Python etcd clients are unmaintained (``etcd3``
no longer imports with current protobuf), take a single host (``aetcd``), or lack leases; the
gateway (``POST /v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/*``, streaming ``/v3/watch``) gives
compare-and-set, leases and watches over plain HTTP/1.1, so relaunch keeps no dependencies and
owns the part that matters for a launcher: failing over between members within a deadline.

Mapping onto the ``Store`` protocol:

* a key's *version* is its ``mod_revision`` (the cluster revision of its last change);
* ``compare_set`` is one transaction comparing ``mod_revision`` (0 for an absent key);
* ``add`` is a compare-and-set loop (etcd has no atomic counter), one round trip when the
  client's last sight of the counter is still current; N clients adding at once make O(N²)
  transactions, so what many nodes count (joins, members done, answers) is counted as keys
  instead: each node writes its own key under a prefix (idempotent, in a ``txn``), and
  ``count_prefix``/``await_prefix_count``/``range_prefix`` read them, O(1) requests each;
* ``watch`` and ``wait`` block on a streaming watch from the revision they read, never polling
  (``open_watch`` hands out such a stream: ``etcd_feed`` keeps one for a node's life);
* leases (``grant_lease``, ``keep_alive``, ``set(..., lease=)``) carry heartbeats: a member that
  dies stops renewing its lease, and etcd deletes its keys.

Every call retries on another member when one cannot be reached, has no leader, or times out,
until the store's ``timeout`` passes (``etcd_gateway``). Passwords never appear in messages or
``repr``. What is sent and read is built and parsed without I/O in ``etcd_shapes``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import relaunch.store.etcd_shapes as shapes
from relaunch.core.durations import seconds
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import CasResult, StoreError, StoreTimeout, Versioned
from relaunch.store.etcd_gateway import Endpoint, Gateway, WatchStream, parse_endpoints
from relaunch.store.etcd_shapes import (
    KeyValue,
    TxnReply,
    absent,
    prefix_end,
    put,
    read,
    shape,
    txn_op,
)

#: ``absent``, ``put``, ``read`` and ``txn_op`` build the parts of ``EtcdStore.txn``.
__all__ = [
    "Endpoint",
    "EtcdStore",
    "KeyValue",
    "TxnReply",
    "WatchStream",
    "absent",
    "parse_endpoints",
    "prefix_end",
    "put",
    "read",
    "txn_op",
]

log = logging.getLogger(__name__)


class EtcdStore:
    """A ``Store`` on the etcd cluster at ``endpoints`` (``"h1:2379,h2:2379"`` or a list).

    ``cacert``/``cert``/``key`` configure TLS (``protocol="https"``); ``user``/``password``
    etcd's authentication. ``timeout`` bounds every call, retries and fail-overs included
    (kept on ``clock``, as the waits are).
    One connection, one request at a time; use one store per thread that blocks in ``watch``.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        protocol: str = "http",
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        text = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
        self.endpoints = parse_endpoints(text, protocol)
        self.timeout = timeout
        self._clock = clock
        self._gateway = Gateway(
            self.endpoints, timeout, cacert, cert, key, user, password, clock=clock
        )
        self._lock = threading.Lock()  # one request at a time on the gateway's connection
        # The last sight of each counter ``add`` wrote: usually still current, saving a read.
        self._counters: dict[str, Versioned] = {}
        self._warned_ttl = False

    def __repr__(self) -> str:
        user = f", user={self._gateway.user!r}" if self._gateway.user else ""
        return f"EtcdStore({self.describe()!r}{user})"

    def describe(self) -> str:
        """The endpoints, as a person would write them."""
        return self._gateway.describe()

    @property
    def attempt_timeout(self) -> float:
        """The longest one attempt of a call waits on one member before the call tries the
        next (``etcd_gateway.ATTEMPT_TIMEOUT`` unless set): the call as a whole still has
        ``timeout``. A member that holds requests (one in the middle of a leader election, one
        cut off from the others) is left after this long for one that answers."""
        return self._gateway.attempt_timeout

    @attempt_timeout.setter
    def attempt_timeout(self, seconds: float) -> None:
        self._gateway.attempt_timeout = seconds

    @property
    def member(self) -> Endpoint:
        """The member requests go to now."""
        return self._gateway.current

    # -- Store ----------------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call to the gateway (``Gateway.call``), one at a time."""
        with self._lock:
            return self._gateway.call(path, body)

    def _range(self, key: str) -> tuple[Versioned, int]:
        """``key``'s value and version, and the cluster revision the read saw."""
        reply = self._post("/v3/kv/range", shapes.key_range(key))
        with shape("a read", reply):
            return shapes.first_key(reply)

    def get(self, key: str) -> Versioned:
        return self._range(key)[0]

    def set(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``value`` (bound to ``lease`` if non-zero: gone when the lease expires)."""
        reply = self._post("/v3/kv/put", shapes.put_request(key, value, lease))
        with shape("a write", reply):
            return shapes.revision_of(reply)

    def compare_set(
        self, key: str, expected_version: int, value: bytes, also: Sequence[str] = ()
    ) -> CasResult:
        """``Store.compare_set``; writing ``value`` to the keys ``also`` too, at the same
        revision (their watchers get one event for all), when it writes ``key``."""
        reply = self._post("/v3/kv/txn", shapes.compare_set(key, expected_version, value, also))
        with shape("a transaction", reply):
            return shapes.cas_result(reply)

    def add(self, key: str, amount: int) -> int:
        current = self._counters.get(key, Versioned(None, 0))
        while True:
            try:
                total = int(current.value or b"0") + amount
            except ValueError:
                raise StoreError(f"cannot add to {key!r}: its value is not an integer") from None
            result = self.compare_set(key, current.version, str(total).encode())
            current = result.current
            if result.succeeded:
                self._counters[key] = current
                return total

    def delete(self, key: str) -> bool:
        self._counters.pop(key, None)
        reply = self._post("/v3/kv/deleterange", shapes.key_range(key))
        with shape("a delete", reply):
            return int(reply.get("deleted", 0)) > 0

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = self._clock.monotonic() + timeout
        for index, key in enumerate(keys):
            left = max(0.0, deadline - self._clock.monotonic())
            if self.watch(key, 0, left).value is None:
                missing = [k for k in keys[index:] if self.get(k).value is None]
                raise StoreTimeout(
                    f"keys still missing after {seconds(timeout)}: " + ", ".join(missing or [key])
                )

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        deadline = self._clock.monotonic() + timeout
        while True:
            current, revision = self._range(key)
            left = deadline - self._clock.monotonic()
            if current.version != version or left <= 0:
                return current
            changed = self._watch_once(key, revision + 1, left)
            if changed is not None and changed.version != version:
                return changed

    def _watch_once(self, key: str, start_revision: int, timeout: float) -> Versioned | None:
        """The first change of ``key`` from ``start_revision`` on, or None: the time ran out,
        or the stream broke (the caller reads again, on another member if need be)."""
        for event in self._events(key, None, start_revision, timeout):
            return shapes.event_value(event)
        return None

    def _events(
        self, key: str, range_end: str | None, start_revision: int, timeout: float
    ) -> Iterator[dict[str, Any]]:
        """The events of a streaming watch on ``key`` (or on every key up to ``range_end``)
        from ``start_revision`` on. The iteration ends when the time runs out or the stream
        breaks; the caller then reads again (on another member, if this one died)."""
        stream = self.open_watch(key, range_end, start_revision, timeout)
        if stream is None:
            return
        try:
            for result in stream.results():
                if result is None:
                    return  # the time ran out
                yield from result.get("events", ())
        finally:
            stream.close()

    def open_watch(
        self, key: str, range_end: str | None, start_revision: int, timeout: float
    ) -> WatchStream | None:
        """Start a streaming watch on ``key`` (or on every key up to ``range_end``) from
        ``start_revision`` on (0: from now), on a connection of its own whose reads wait up to
        ``timeout``; None when the member refused it or could not be reached (the next call
        goes to another member)."""
        gateway = self._gateway
        with self._lock:
            endpoint = gateway.current
            if gateway.needs_token:
                gateway.call("/v3/kv/range", shapes.key_range(key))  # authenticates
        conn = gateway.connection(endpoint, timeout)
        request = shapes.watch_request(key, range_end, start_revision)
        try:
            response = gateway.post(conn, "/v3/watch", request)
            if response.status != 200:
                response.read()
                if response.status == 401:
                    with self._lock:
                        gateway.forget_token()
                conn.close()
                return None
        except TimeoutError:  # the caller's time ran out
            conn.close()
            return None
        except (OSError, ValueError):
            conn.close()
            self._member_failed(endpoint)
            return None
        return WatchStream(conn, response, endpoint, self._member_failed)

    def _member_failed(self, endpoint: Endpoint) -> None:
        """A stream to ``endpoint`` broke: the next request goes to another member."""
        with self._lock:
            if self._gateway.current == endpoint:
                self._gateway.rotate()

    # -- keys under a prefix: what many nodes count ------------------------------------------

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> TxnReply:
        """One transaction (build its parts with ``absent``, ``put``, ``read``, ``txn_op``):
        several reads and writes in one request, at one revision."""
        reply = self._post("/v3/kv/txn", shapes.txn(compare, success, failure))
        with shape("a transaction", reply):
            return shapes.txn_reply(reply)

    def count_prefix(self, prefix: str) -> tuple[int, int]:
        """How many keys start with ``prefix``, and the cluster revision of that count."""
        reply = self._post("/v3/kv/range", {**shapes.prefix_range(prefix), "count_only": True})
        with shape("a count", reply):
            return int(reply.get("count", 0)), shapes.revision_of(reply)

    def range_prefix(self, prefix: str, limit: int = 0) -> list[tuple[str, bytes, int]]:
        """The first ``limit`` keys (0: all) under ``prefix`` in the order they were created:
        ``(key, value, create revision)`` each."""
        body = {
            **shapes.prefix_range(prefix),
            "sort_target": "CREATE",
            "sort_order": "ASCEND",
            "limit": str(limit),
        }
        reply = self._post("/v3/kv/range", body)
        with shape("a range read", reply):
            return shapes.created_keys(reply)

    def read_prefix(self, prefix: str, limit: int = 0) -> tuple[dict[str, Versioned], int]:
        """Every key under ``prefix`` (the first ``limit``, if not 0), and the cluster
        revision they were read at."""
        reply = self._post("/v3/kv/range", shapes.prefix_range(prefix, limit))
        with shape("a range read", reply):
            return shapes.keys_read(reply, limit)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; how many there were."""
        reply = self._post("/v3/kv/deleterange", shapes.prefix_range(prefix))
        self._counters = {k: v for k, v in self._counters.items() if not k.startswith(prefix)}
        with shape("a delete", reply):
            return int(reply.get("deleted", 0))

    def await_prefix_count(self, prefix: str, at_least: int, timeout: float) -> int:
        """Block until ``at_least`` keys exist under ``prefix`` (or ``timeout`` passed); the
        count then. One streaming watch from the revision counted: O(1) requests, never a poll."""
        deadline = self._clock.monotonic() + timeout
        while True:
            count, revision = self.count_prefix(prefix)
            left = deadline - self._clock.monotonic()
            if count >= at_least or left <= 0:
                return count
            self._watch_prefix_growth(prefix, revision + 1, count, at_least, left)

    def _watch_prefix_growth(
        self, prefix: str, start_revision: int, count: int, at_least: int, timeout: float
    ) -> None:
        """Follow creations and deletions under ``prefix`` from ``start_revision`` until the
        count reaches ``at_least``, the time runs out or the stream breaks."""
        for event in self._events(prefix, prefix_end(prefix), start_revision, timeout):
            if event.get("type") == "DELETE":
                count -= 1
            elif event["kv"].get("version") == "1":  # created, not overwritten
                count += 1
            if count >= at_least:
                return

    # -- leases ---------------------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up to whole seconds); its id."""
        asked = shapes.lease_seconds(ttl)
        reply = self._post("/v3/lease/grant", {"TTL": str(asked)})
        with shape("a lease grant", reply):
            granted, lease = shapes.lease_granted(reply, asked)
        if granted > asked and not self._warned_ttl:
            self._warned_ttl = True
            log.warning(
                "etcd granted leases of %ds for the %ds asked (its minimum, 1.5 election "
                "timeouts): a lost node is noticed up to %ds later",
                granted,
                asked,
                granted - asked,
            )
        return lease

    def keep_alive(self, lease: int) -> bool:
        """Renew ``lease``; False when it already expired (its keys are gone)."""
        try:
            reply = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        except StoreError as exc:
            if "lease not found" in str(exc):  # expired, and etcd already forgot it
                return False
            raise
        with shape("a lease renewal", reply):
            return shapes.lease_renewed(reply)

    def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys."""
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    def close(self) -> None:
        with self._lock:
            self._gateway.drop()
