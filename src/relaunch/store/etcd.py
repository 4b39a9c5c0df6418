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
  transactions (the limit of this backend at a thousand nodes joining at once);
* ``watch`` and ``wait`` block on a streaming watch from the revision they read, never polling;
* leases (``grant_lease``, ``keep_alive``, ``set(..., lease=)``) carry heartbeats: a member that
  dies stops renewing its lease, and etcd deletes its keys.

Every call retries on another member when one cannot be reached, has no leader, or times out,
until the store's ``timeout`` passes (``etcd_gateway``). Passwords never appear in messages or
``repr``.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from relaunch.store.api import CasResult, StoreError, StoreProtocolError, StoreTimeout, Versioned
from relaunch.store.etcd_gateway import Endpoint, Gateway, parse_endpoints

__all__ = ["Endpoint", "EtcdStore", "parse_endpoints"]

log = logging.getLogger(__name__)


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

    # -- Store ----------------------------------------------------------------------------------

    def _range(self, key: str) -> tuple[Versioned, int]:
        """``key``'s value and version, and the cluster revision the read saw."""
        with self._lock:
            reply = self._gateway.call("/v3/kv/range", {"key": _key_b64(key)})
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
        return int(reply["header"]["revision"])

    def compare_set(self, key: str, expected_version: int, value: bytes) -> CasResult:
        encoded = _key_b64(key)
        read = {"request_range": {"key": encoded}}
        body = {
            "compare": [
                {
                    "key": encoded,
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(expected_version),
                }
            ],
            "success": [{"request_put": {"key": encoded, "value": _b64(value)}}, read],
            "failure": [read],
        }
        with self._lock:
            reply = self._gateway.call("/v3/kv/txn", body)
        responses = reply.get("responses", [])
        try:
            current = _versioned(_first_kv(responses[-1]["response_range"]))
        except (IndexError, KeyError):
            raise StoreProtocolError(f"etcd answered a transaction with {reply!r}") from None
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
        return int(reply.get("deleted", 0)) > 0

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for index, key in enumerate(keys):
            if self.watch(key, 0, max(0.0, deadline - time.monotonic())).value is None:
                missing = [k for k in keys[index:] if self.get(k).value is None]
                raise StoreTimeout(
                    f"keys still missing after {timeout:g}s: " + ", ".join(missing or [key])
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
        gateway = self._gateway
        with self._lock:
            endpoint = gateway.current
            if gateway.needs_token:
                gateway.call("/v3/kv/range", {"key": _key_b64(key)})  # authenticates
        conn = gateway.connection(endpoint, timeout)
        body = {"create_request": {"key": _key_b64(key), "start_revision": str(start_revision)}}
        try:
            response = gateway.post(conn, "/v3/watch", body)
            if response.status != 200:
                response.read()
                if response.status == 401:
                    with self._lock:
                        gateway.forget_token()
                return None
            while True:
                line = response.readline()
                if not line:
                    break  # the member closed the stream
                message = json.loads(line)
                result = message.get("result")
                if (
                    result is None
                    or int(result.get("compact_revision", 0))
                    or result.get("canceled")
                ):
                    break
                for event in result.get("events", ()):
                    if event.get("type") == "DELETE":
                        return Versioned(None, 0)
                    return _versioned(event["kv"])
        except TimeoutError:
            pass
        except (OSError, http.client.HTTPException, ValueError):
            with self._lock:
                if gateway.current == endpoint:
                    gateway.rotate()  # the member died under the stream: read elsewhere
        finally:
            conn.close()
        return None

    # -- leases ---------------------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up to whole seconds); its id."""
        asked = max(1, int(-(-ttl // 1)))
        with self._lock:
            reply = self._gateway.call("/v3/lease/grant", {"TTL": str(asked)})
        granted = int(reply.get("TTL", asked))
        if granted > asked and not self._warned_ttl:
            self._warned_ttl = True
            log.warning(
                "etcd granted leases of %ds for the %ds asked (its minimum, 1.5 election "
                "timeouts): a lost node is noticed up to %ds later",
                granted,
                asked,
                granted - asked,
            )
        return int(reply["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renew ``lease``; False when it already expired (its keys are gone)."""
        with self._lock:
            reply = self._gateway.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(reply.get("result", {}).get("TTL", 0)) > 0

    def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys."""
        with self._lock:
            self._gateway.call("/v3/lease/revoke", {"ID": str(lease)})

    def close(self) -> None:
        with self._lock:
            self._gateway.drop()
