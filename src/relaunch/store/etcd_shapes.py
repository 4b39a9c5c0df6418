"""The JSON spoken to etcd's gRPC-JSON gateway, without I/O: the requests ``EtcdStore`` sends
(keys and values in base64, key ranges, transactions and their parts), and what it reads from
the replies.

``malformed`` checks the type of every field relaunch reads, wherever it appears, before a reply
goes further (``etcd_gateway`` fails over from a member that answers so); the readers read a
reply within ``shape``, so that one of another shape still ends in one ``StoreProtocolError``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from relaunch.store.api import CasResult, StoreProtocolError, Versioned

#: What reading a reply of the wrong shape raises: made a ``StoreProtocolError`` (``shape``).
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, IndexError, binascii.Error)


@contextmanager
def shape(what: str, reply: object) -> Iterator[None]:
    """Read ``reply`` (what etcd answered ``what``) in the block: a reply of the wrong shape
    ends it with one ``StoreProtocolError``, never another exception."""
    try:
        yield
    except _SHAPE_ERRORS:
        shown = repr(reply)
        shown = shown if len(shown) <= 200 else shown[:197] + "..."
        raise StoreProtocolError(f"etcd answered {what} with {shown}") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def key_b64(key: str) -> str:
    return b64(key.encode())


def key_of(kv: dict[str, Any]) -> str:
    """The key of a gateway ``KeyValue``."""
    return base64.b64decode(kv["key"]).decode()


def versioned(kv: dict[str, Any] | None) -> Versioned:
    """A gateway ``KeyValue`` (empty fields omitted) as a ``Versioned``."""
    if kv is None:
        return Versioned(None, 0)
    return Versioned(base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0)))


def event_value(event: dict[str, Any]) -> Versioned:
    """What a watch event left its key as (absent after a delete)."""
    if event.get("type") == "DELETE":
        return Versioned(None, 0)
    return versioned(event["kv"])


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


# -- replies --------------------------------------------------------------------------------------


#: Fields etcd's gateway sends as 64-bit integers (in JSON strings), wherever they appear.
_INTEGERS = frozenset(
    [
        "revision",
        "create_revision",
        "mod_revision",
        "version",
        "lease",
        "count",
        "deleted",
        "ID",
        "TTL",
        "grantedTTL",
        "raft_term",
        "cluster_id",
        "member_id",
        "compact_revision",
        "watch_id",
    ]
)
_KEYVALUES = frozenset(("kvs", "prev_kvs"))
_KEYVALUE = frozenset(("kv", "prev_kv"))
_OBJECTS = frozenset(
    ["header", "result", "response_range", "response_put", "response_txn", "response_delete_range"]
)
_FLAGS = frozenset(("succeeded", "more", "created", "canceled"))


def malformed(reply: object, depth: int = 0) -> str | None:
    """What makes ``reply`` no reply etcd's gateway sends (None if nothing): each field that
    relaunch reads checked for its type wherever it appears, so that a member answering with
    the wrong shape is a failed member (the next one is tried), never a crash further on."""
    if not isinstance(reply, dict):
        return f"{type(reply).__name__} where an object belongs"
    if depth > 8:
        return "objects nested too deep"
    for name, value in reply.items():
        if name in _INTEGERS:
            text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
            if not (isinstance(text, str) and text.lstrip("-").isdigit() and len(text) <= 20):
                return f"{name}={value!r:.40}"
        elif name in ("key", "value", "token", "range_end"):
            if not isinstance(value, str):
                return f"{name} of type {type(value).__name__}"
        elif name in _FLAGS:
            if not isinstance(value, bool):
                return f"{name}={value!r:.40}"
        elif name in _KEYVALUES or name == "responses" or name == "events":
            if not isinstance(value, list):
                return f"{name} of type {type(value).__name__}"
            for item in value:
                if (wrong := malformed(item, depth + 1)) is not None:
                    return f"{name}: {wrong}"
                if name != "responses" and name != "events" and "key" not in item:
                    return f"{name}: a key-value without its key"
        elif (name in _KEYVALUE or name in _OBJECTS) and (
            wrong := malformed(value, depth + 1)
        ) is not None:
            return f"{name}: {wrong}"
    return None


def watch_result(line: bytes) -> dict[str, Any] | None:
    """The result a streaming watch's line carries (None: none, the stream ends); ValueError
    for a line that is no JSON, or a result of the wrong shape."""
    message = json.loads(line)
    result: dict[str, Any] | None = message.get("result") if isinstance(message, dict) else None
    if result is not None and malformed(result) is not None:
        raise ValueError(f"a watch result of the wrong shape: {line[:200]!r}")
    return result


def revision_of(reply: dict[str, Any]) -> int:
    """The cluster revision a reply was made at."""
    return int(reply["header"]["revision"])


# -- key ranges ----------------------------------------------------------------------------------


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range or watch cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b64(b"\0")  # every key
    raw[-1] += 1
    return b64(bytes(raw))


def key_range(key: str) -> dict[str, Any]:
    """A range request (read, delete) for the one key ``key``."""
    return {"key": key_b64(key)}


def prefix_range(prefix: str, limit: int = 0) -> dict[str, Any]:
    """A range request (read, delete) for every key under ``prefix`` (the first ``limit``)."""
    request: dict[str, Any] = {"key": key_b64(prefix), "range_end": prefix_end(prefix)}
    if limit:
        request["limit"] = str(limit)
    return request


def watch_request(key: str, range_end: str | None, start_revision: int) -> dict[str, Any]:
    """The request that creates a watch on ``key`` (or every key up to ``range_end``) from
    ``start_revision`` on (0: from now)."""
    request = key_range(key)
    if start_revision:
        request["start_revision"] = str(start_revision)
    if range_end is not None:
        request["range_end"] = range_end
    return {"create_request": request}


# -- transactions --------------------------------------------------------------------------------


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
            key_of(kv),
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
    return {"key": key_b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def put_request(key: str, value: bytes, lease: int = 0) -> dict[str, Any]:
    """A write of ``value`` to ``key``, bound to ``lease`` if non-zero (gone when it expires)."""
    request: dict[str, Any] = {"key": key_b64(key), "value": b64(value)}
    if lease:
        request["lease"] = str(lease)
    return request


def put(key: str, value: bytes, previous: bool = False) -> dict[str, Any]:
    """A transaction operation writing ``key``; ``previous``: its reply holds the key as it
    was, if it was (``TxnReply.reads``)."""
    request = put_request(key, value)
    if previous:
        request["prev_kv"] = True
    return {"request_put": request}


def read(key: str) -> dict[str, Any]:
    """A transaction operation reading ``key``."""
    return {"request_range": key_range(key)}


def txn_op(
    compare: list[dict[str, Any]],
    success: list[dict[str, Any]],
    failure: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A transaction nested in another (what it reads is not returned)."""
    return {"request_txn": txn(compare, success, failure or [])}


def txn(
    compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]
) -> dict[str, Any]:
    """A transaction request."""
    return {"compare": compare, "success": success, "failure": failure}


def compare_set(
    key: str, expected_version: int, value: bytes, also: Sequence[str]
) -> dict[str, Any]:
    """The transaction of ``EtcdStore.compare_set``: write ``value`` to ``key`` and the keys
    ``also`` when ``key``'s version is ``expected_version``; read ``key`` last either way."""
    unchanged = {
        "key": key_b64(key),
        "target": "MOD",
        "result": "EQUAL",
        "mod_revision": str(expected_version),
    }
    writes = [put(k, value) for k in (key, *also)]
    return txn([unchanged], [*writes, read(key)], [read(key)])


def cas_result(reply: dict[str, Any]) -> CasResult:
    """A ``compare_set`` transaction's outcome (its last operation read the key)."""
    responses = reply.get("responses", [])
    current = versioned(_first_kv(responses[-1]["response_range"]))
    return CasResult(bool(reply.get("succeeded", False)), current)


def txn_reply(reply: dict[str, Any]) -> TxnReply:
    """A transaction's reply, read."""
    responses = reply.get("responses", ())
    reads = [_read_of(response) for response in responses]
    return TxnReply(
        bool(reply.get("succeeded", False)),
        revision_of(reply),
        [None if kv is None else KeyValue.of(kv) for kv in reads],
        [
            bool(response["response_txn"].get("succeeded", False))
            for response in responses
            if "response_txn" in response
        ],
    )


# -- range replies -------------------------------------------------------------------------------


def first_key(reply: dict[str, Any]) -> tuple[Versioned, int]:
    """A one-key range reply: the key's value and version, and the revision read at."""
    return versioned(_first_kv(reply)), revision_of(reply)


def created_keys(reply: dict[str, Any]) -> list[tuple[str, bytes, int]]:
    """A range reply's keys as ``(key, value, create revision)``."""
    return [
        (key_of(kv), base64.b64decode(kv.get("value", "")), int(kv["create_revision"]))
        for kv in reply.get("kvs", ())
    ]


def keys_read(reply: dict[str, Any], limit: int) -> tuple[dict[str, Versioned], int]:
    """A range reply of at most ``limit`` keys (0: any number): each key's value and version,
    and the revision read at."""
    kvs = reply.get("kvs", ())
    if limit and len(kvs) > limit:
        raise ValueError("more keys than asked for")
    return {key_of(kv): versioned(kv) for kv in kvs}, revision_of(reply)


# -- leases --------------------------------------------------------------------------------------


def lease_seconds(ttl: float) -> int:
    """The whole seconds a lease of ``ttl`` is asked for (rounded up, at least 1)."""
    return max(1, int(-(-ttl // 1)))


def lease_granted(reply: dict[str, Any], asked: int) -> tuple[int, int]:
    """A lease grant's reply: the seconds granted and the lease's id."""
    return int(reply.get("TTL", asked)), int(reply["ID"])


def lease_renewed(reply: dict[str, Any]) -> bool:
    """Whether a keep-alive's reply says the lease lives on."""
    return int(reply.get("result", {}).get("TTL", 0)) > 0
