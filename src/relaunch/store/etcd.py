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
``repr``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from relaunch.core.durations import seconds
from relaunch.store import http1
from relaunch.store.api import CasResult, StoreError, StoreProtocolError, StoreTimeout, Versioned
from relaunch.store.etcd_gateway import Endpoint, Gateway, malformed, parse_endpoints

__all__ = [
    "Endpoint",
    "EtcdStore",
    "KeyValue",
    "TxnReply",
    "WatchStream",
    "parse_endpoints",
    "prefix_end",
]

log = logging.getLogger(__name__)


#: What reading a reply of the wrong shape raises: made a ``StoreProtocolError`` (``_shape``).
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, binascii.Error)


@contextmanager
def _shape(what: str, reply: object) -> Iterator[None]:
    """Read ``reply`` (what etcd answered ``what``) in the block: a reply of the wrong shape
    ends it with one ``StoreProtocolError``, never another exception."""
    try:
        yield
    except _SHAPE_ERRORS:
        shown = repr(reply)
        shown = shown if len(shown) <= 200 else shown[:197] + "..."
        raise StoreProtocolError(f"etcd answered {what} with {shown}") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _key_b64(key: str) -> str:
    return _b64(key.encode())


def _versioned(kv: dict[str, Any] | None) -> Versioned:
    """A gateway ``KeyValue`` (empty fields omitted) as a ``Versioned``."""
    if kv is None:
        return Versioned(None, 0)
    return Versioned(base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0)))


def _first_kv(range_response: dict[str, Any]) -> dict[str, Any] | None:
    kvs = range_response.get("kvs")
    return kvs[0] if kvs else None


def _read_of(response: dict[str, Any]) -> dict[str, Any] | None:
    """What a transaction's operation read: a range's key, or a put's previous key."""
    if "response_range" in response:
        return _first_kv(response["response_range"])
    if "response_put" in response:
        previous: dict[str, Any] | None = response["response_put"].get("prev_kv")
        return previous
    return None


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _b64(b"\0")  # every key
    raw[-1] += 1
    return _b64(bytes(raw))


@dataclass(frozen=True)
class KeyValue:
    """A key as a transaction read it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int

    @classmethod
    def of(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            base64.b64decode(kv["key"]).decode(),
            base64.b64decode(kv.get("value", "")),
            int(kv.get("create_revision", 0)),
            int(kv.get("mod_revision", 0)),
        )


@dataclass(frozen=True)
class TxnReply:
    """A transaction's outcome: which branch ran, at what revision, what each of its
    operations read (a read: the key; a ``put(previous=True)``: the key before, if any; else
    None), and whether each of its nested transactions' comparisons held, in order."""

    succeeded: bool
    revision: int
    reads: list[KeyValue | None]
    nested: list[bool]


def absent(key: str) -> dict[str, Any]:
    """A transaction comparison: ``key`` does not exist."""
    return {"key": _key_b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def put(key: str, value: bytes, previous: bool = False) -> dict[str, Any]:
    """A transaction operation writing ``key``; ``previous``: its reply holds the key as it
    was, if it was (``TxnReply.reads``)."""
    request: dict[str, Any] = {"key": _key_b64(key), "value": _b64(value)}
    if previous:
        request["prev_kv"] = True
    return {"request_put": request}


def read(key: str) -> dict[str, Any]:
    """A transaction operation reading ``key``."""
    return {"request_range": {"key": _key_b64(key)}}


def txn_op(
    compare: list[dict[str, Any]],
    success: list[dict[str, Any]],
    failure: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A transaction nested in another (what it reads is not returned)."""
    return {"request_txn": {"compare": compare, "success": success, "failure": failure or []}}


class WatchStream:
    """One streaming watch, open on a connection of its own (``EtcdStore.open_watch``)."""

    def __init__(
        self, store: EtcdStore, conn: http1.Connection, response: http1.Response, endpoint: Endpoint
    ) -> None:
        self._store, self._conn, self._response = store, conn, response
        self._endpoint = endpoint
        self.compacted = False  # whether it ended behind a compaction

    @property
    def endpoint(self) -> Endpoint:
        """The member the stream is on."""
        return self._endpoint

    def results(self) -> Iterator[dict[str, Any] | None]:
        """The stream's results (the first says it was created), and None each time a read
        waited the connection's timeout in vain. The iteration ends when the stream breaks,
        is cancelled or falls behind a compaction (``compacted``); a member that died under it
        is left for another (``EtcdStore.open_watch``)."""
        response = self._response
        try:
            while True:
                try:
                    line = response.readline()
                except TimeoutError:
                    yield None
                    continue
                if not line:
                    return  # the member closed the stream
                message = json.loads(line)
                result = message.get("result") if isinstance(message, dict) else None
                if result is None:
                    return
                if malformed(result) is not None:
                    raise ValueError(f"a watch result of the wrong shape: {line[:200]!r}")
                if int(result.get("compact_revision", 0)):
                    self.compacted = True
                    return
                if result.get("canceled"):
                    return
                yield result
        except (OSError, ValueError):
            if not self._conn.interrupted:
                self._store._member_failed(self._endpoint)

    def interrupt(self) -> None:
        """Wake a thread reading the stream (from another thread): its ``results`` end."""
        self._conn.interrupt()

    def close(self) -> None:
        self._conn.close()


class EtcdStore:
    """A ``Store`` on the etcd cluster at ``endpoints`` (``"h1:2379,h2:2379"`` or a list).

    ``cacert``/``cert``/``key`` configure TLS (``protocol="https"``); ``user``/``password``
    etcd's authentication. ``timeout`` bounds every call, retries and fail-overs included.
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
    ) -> None:
        text = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
        self.endpoints = parse_endpoints(text, protocol)
        self.timeout = timeout
        self._gateway = Gateway(self.endpoints, timeout, cacert, cert, key, user, password)
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

    def _range(self, key: str) -> tuple[Versioned, int]:
        """``key``'s value and version, and the cluster revision the read saw."""
        with self._lock:
            reply = self._gateway.call("/v3/kv/range", {"key": _key_b64(key)})
        with _shape("a read", reply):
            return _versioned(_first_kv(reply)), int(reply["header"]["revision"])

    def get(self, key: str) -> Versioned:
        return self._range(key)[0]

    def set(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``value`` (bound to ``lease`` if non-zero: gone when the lease expires)."""
        body: dict[str, Any] = {"key": _key_b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        with self._lock:
            reply = self._gateway.call("/v3/kv/put", body)
        with _shape("a write", reply):
            return int(reply["header"]["revision"])

    def compare_set(
        self, key: str, expected_version: int, value: bytes, also: Sequence[str] = ()
    ) -> CasResult:
        """``Store.compare_set``; writing ``value`` to the keys ``also`` too, at the same
        revision (their watchers get one event for all), when it writes ``key``."""
        encoded = _key_b64(key)
        read = {"request_range": {"key": encoded}}
        writes = [put(k, value) for k in (key, *also)]
        body = {
            "compare": [
                {
                    "key": encoded,
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(expected_version),
                }
            ],
            "success": [*writes, read],
            "failure": [read],
        }
        with self._lock:
            reply = self._gateway.call("/v3/kv/txn", body)
        with _shape("a transaction", reply):
            responses = reply.get("responses", [])
            current = _versioned(_first_kv(responses[-1]["response_range"]))
            return CasResult(bool(reply.get("succeeded", False)), current)

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
        with self._lock:
            reply = self._gateway.call("/v3/kv/deleterange", {"key": _key_b64(key)})
        with _shape("a delete", reply):
            return int(reply.get("deleted", 0)) > 0

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for index, key in enumerate(keys):
            if self.watch(key, 0, max(0.0, deadline - time.monotonic())).value is None:
                missing = [k for k in keys[index:] if self.get(k).value is None]
                raise StoreTimeout(
                    f"keys still missing after {seconds(timeout)}: " + ", ".join(missing or [key])
                )

    def watch(self, key: str, version: int, timeout: float) -> Versioned:
        deadline = time.monotonic() + timeout
        while True:
            current, revision = self._range(key)
            left = deadline - time.monotonic()
            if current.version != version or left <= 0:
                return current
            changed = self._watch_once(key, revision + 1, left)
            if changed is not None and changed.version != version:
                return changed

    def _watch_once(self, key: str, start_revision: int, timeout: float) -> Versioned | None:
        """The first change of ``key`` from ``start_revision`` on, or None: the time ran out,
        or the stream broke (the caller reads again, on another member if need be)."""
        for event in self._events(key, None, start_revision, timeout):
            if event.get("type") == "DELETE":
                return Versioned(None, 0)
            return _versioned(event["kv"])
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
                gateway.call("/v3/kv/range", {"key": _key_b64(key)})  # authenticates
        conn = gateway.connection(endpoint, timeout)
        request: dict[str, Any] = {"key": _key_b64(key)}
        if start_revision:
            request["start_revision"] = str(start_revision)
        if range_end is not None:
            request["range_end"] = range_end
        try:
            response = gateway.post(conn, "/v3/watch", {"create_request": request})
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
        return WatchStream(self, conn, response, endpoint)

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
        body = {"compare": compare, "success": success, "failure": failure}
        with self._lock:
            reply = self._gateway.call("/v3/kv/txn", body)
        with _shape("a transaction", reply):
            responses = reply.get("responses", ())
            reads = [_read_of(response) for response in responses]
            return TxnReply(
                bool(reply.get("succeeded", False)),
                int(reply["header"]["revision"]),
                [None if kv is None else KeyValue.of(kv) for kv in reads],
                [
                    bool(response["response_txn"].get("succeeded", False))
                    for response in responses
                    if "response_txn" in response
                ],
            )

    def count_prefix(self, prefix: str) -> tuple[int, int]:
        """How many keys start with ``prefix``, and the cluster revision of that count."""
        body = {"key": _key_b64(prefix), "range_end": prefix_end(prefix), "count_only": True}
        with self._lock:
            reply = self._gateway.call("/v3/kv/range", body)
        with _shape("a count", reply):
            return int(reply.get("count", 0)), int(reply["header"]["revision"])

    def range_prefix(self, prefix: str, limit: int = 0) -> list[tuple[str, bytes, int]]:
        """The first ``limit`` keys (0: all) under ``prefix`` in the order they were created:
        ``(key, value, create revision)`` each."""
        body = {
            "key": _key_b64(prefix),
            "range_end": prefix_end(prefix),
            "sort_target": "CREATE",
            "sort_order": "ASCEND",
            "limit": str(limit),
        }
        with self._lock:
            reply = self._gateway.call("/v3/kv/range", body)
        with _shape("a range read", reply):
            return [
                (
                    base64.b64decode(kv["key"]).decode(),
                    base64.b64decode(kv.get("value", "")),
                    int(kv["create_revision"]),
                )
                for kv in reply.get("kvs", ())
            ]

    def read_prefix(self, prefix: str, limit: int = 0) -> tuple[dict[str, Versioned], int]:
        """Every key under ``prefix`` (the first ``limit``, if not 0), and the cluster
        revision they were read at."""
        body = {"key": _key_b64(prefix), "range_end": prefix_end(prefix)}
        if limit:
            body["limit"] = str(limit)
        with self._lock:
            reply = self._gateway.call("/v3/kv/range", body)
        with _shape("a range read", reply):
            kvs = reply.get("kvs", ())
            if limit and len(kvs) > limit:
                raise ValueError("more keys than asked for")
            keys = {KeyValue.of(kv).key: _versioned(kv) for kv in kvs}
            return keys, int(reply["header"]["revision"])

    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under ``prefix``; how many there were."""
        body = {"key": _key_b64(prefix), "range_end": prefix_end(prefix)}
        with self._lock:
            reply = self._gateway.call("/v3/kv/deleterange", body)
        self._counters = {k: v for k, v in self._counters.items() if not k.startswith(prefix)}
        with _shape("a delete", reply):
            return int(reply.get("deleted", 0))

    def await_prefix_count(self, prefix: str, at_least: int, timeout: float) -> int:
        """Block until ``at_least`` keys exist under ``prefix`` (or ``timeout`` passed); the
        count then. One streaming watch from the revision counted: O(1) requests, never a poll."""
        deadline = time.monotonic() + timeout
        while True:
            count, revision = self.count_prefix(prefix)
            left = deadline - time.monotonic()
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
        asked = max(1, int(-(-ttl // 1)))
        with self._lock:
            reply = self._gateway.call("/v3/lease/grant", {"TTL": str(asked)})
        with _shape("a lease grant", reply):
            granted, lease = int(reply.get("TTL", asked)), int(reply["ID"])
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
            with self._lock:
                reply = self._gateway.call("/v3/lease/keepalive", {"ID": str(lease)})
        except StoreError as exc:
            if "lease not found" in str(exc):  # expired, and etcd already forgot it
                return False
            raise
        with _shape("a lease renewal", reply):
            return int(reply.get("result", {}).get("TTL", 0)) > 0

    def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys."""
        with self._lock:
            self._gateway.call("/v3/lease/revoke", {"ID": str(lease)})

    def close(self) -> None:
        with self._lock:
            self._gateway.drop()
