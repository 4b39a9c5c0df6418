"""etcd's gRPC-JSON gateway, spoken with the stdlib: requests that fail over between members.

Every call retries on another member when one cannot be reached, has no leader, or times out,
until the deadline passes; it authenticates (again) when etcd wants a token. The deadline is the
call's as a whole (``deadline.Deadline``): each attempt gets a share of what is left, so that a
member that answers a byte at a time is left for the next one in time, and the call ends by its
deadline whatever the members do. Passwords never
appear in messages or ``repr``. ``etcd.EtcdStore`` builds the ``Store`` on it.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass
from typing import Any

from relaunch.core.durations import seconds
from relaunch.endpoints import parse_endpoint
from relaunch.store import http1
from relaunch.store.api import StoreAuthError, StoreConnectionError, StoreError
from relaunch.store.deadline import Deadline

DEFAULT_PORT = 2379
#: The longest a single attempt waits on one member before trying the next (by default: a
#: store whose calls must be timely, such as a heartbeat's, sets its own ``attempt_timeout``).
ATTEMPT_TIMEOUT = 5.0
#: The least an attempt is given, however many members are still to try.
MIN_SHARE = 0.05
#: gRPC status codes etcd answers while it cannot serve: retry, on another member if need be.
_RETRY_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE
_UNAUTHENTICATED = 16
_RETRY_MESSAGES = ("leader", "timed out", "too many requests", "not capable", "stopped")
_BAD_TOKEN_MESSAGES = ("invalid auth token", "user name is empty")


@dataclass(frozen=True)
class Endpoint:
    """One etcd member's client URL."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_endpoints(text: str, protocol: str = "http") -> list[Endpoint]:
    """``host1:2379,https://host2:2379,...`` into endpoints; ValueError saying what is wrong."""
    if protocol not in ("http", "https"):
        raise ValueError(f"protocol={protocol!r}: expected http or https")
    endpoints = []
    for item in text.split(","):
        item = item.strip()
        scheme = protocol
        if "://" in item:
            scheme, _, item = item.partition("://")
            if scheme not in ("http", "https"):
                raise ValueError(f"etcd endpoint scheme {scheme!r}: expected http or https")
        item = item.rstrip("/")
        if not item:
            raise ValueError(f"etcd endpoints {text!r}: expected HOST:PORT[,HOST:PORT...]")
        host, port = parse_endpoint(item, DEFAULT_PORT)
        endpoints.append(Endpoint(scheme, host, port))
    return endpoints


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


class _Retry(Exception):
    """This attempt failed in a way another attempt (on another member) may not."""


class Gateway:
    """Requests to the etcd cluster at ``endpoints``, each within ``timeout`` seconds.

    ``cacert``/``cert``/``key`` configure TLS; ``user``/``password`` etcd's authentication.
    One connection, one request at a time: the caller serialises its calls.
    """

    def __init__(
        self,
        endpoints: list[Endpoint],
        timeout: float,
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self.user = user
        self._password = password
        if (user is None) != (password is None):
            raise ValueError("etcd authentication needs both user and password")
        if key is not None and cert is None:
            raise ValueError("etcd TLS: key= needs cert= too")
        self._ssl: ssl.SSLContext | None = None
        if any(e.scheme == "https" for e in self.endpoints) or cacert or cert:
            self._ssl = ssl.create_default_context(cafile=cacert)
            if cert is not None:
                self._ssl.load_cert_chain(cert, key)
        self._token: str | None = None
        self.attempt_timeout = ATTEMPT_TIMEOUT
        self._current = 0
        self._conn: http1.Connection | None = None

    def describe(self) -> str:
        """The endpoints, as a person would write them."""
        return ", ".join(str(e) for e in self.endpoints)

    @property
    def current(self) -> Endpoint:
        """The member requests go to now."""
        return self.endpoints[self._current]

    @property
    def needs_token(self) -> bool:
        """Whether the next request must authenticate first."""
        return self.user is not None and self._token is None

    def forget_token(self) -> None:
        """Drop a token etcd refused: the next request authenticates again."""
        self._token = None

    def connection(self, endpoint: Endpoint, timeout: float) -> http1.Connection:
        """A new connection to ``endpoint`` (TLS when its scheme says so)."""
        context = self._ssl if endpoint.scheme == "https" else None
        return http1.Connection(endpoint.host, endpoint.port, timeout, context)

    def drop(self) -> None:
        """Close the connection requests go through; the next request opens another."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def rotate(self) -> None:
        """Move on to the next member (this one failed)."""
        self.drop()
        self._current = (self._current + 1) % len(self.endpoints)

    def post(
        self,
        conn: http1.Connection,
        path: str,
        body: dict[str, Any],
        authorized: bool = True,
        deadline: Deadline | None = None,
    ) -> http1.Response:
        """Send one JSON request on ``conn``, with the token unless ``authorized`` is False;
        the request, its reply's body included, ends by ``deadline`` (default: the
        connection's timeout)."""
        headers = {"Content-Type": "application/json"}
        if authorized and self._token is not None:
            headers["Authorization"] = self._token
        return conn.post(path, json.dumps(body).encode(), headers, deadline)

    def _attempt(
        self, path: str, body: dict[str, Any], deadline: Deadline, authorized: bool = True
    ) -> dict[str, Any]:
        """One request to the current member, by ``deadline``; ``_Retry`` when another member
        may do better."""
        endpoint = self.endpoints[self._current]
        try:
            if self._conn is None:
                self._conn = self.connection(endpoint, deadline.seconds)
            response = self.post(self._conn, path, body, authorized, deadline)
            payload = response.read()
        except TimeoutError:
            self.rotate()
            raise _Retry(f"{endpoint}: no complete reply within {deadline.seconds:.2g}s") from None
        except (OSError, ValueError) as exc:
            self.rotate()
            raise _Retry(f"{endpoint}: {exc or type(exc).__name__}") from None
        try:
            decoded = json.loads(payload) if payload else {}
        except (ValueError, RecursionError):
            decoded = None
        if not isinstance(decoded, dict):
            self.rotate()
            raise _Retry(
                f"{endpoint}: answered HTTP {response.status} with a body that is "
                "not a JSON object (is this an etcd v3 client port?)"
            ) from None
        reply: dict[str, Any] = decoded
        if response.status == 200 and "error" not in reply:
            wrong = malformed(reply)
            if wrong is None and path.startswith("/v3/kv/") and "header" not in reply:
                wrong = "no header"
            if wrong is not None:
                self.rotate()
                raise _Retry(
                    f"{endpoint}: answered {path} with a reply of the wrong shape ({wrong})"
                )
            return reply
        message = str(reply.get("message") or reply.get("error") or f"HTTP {response.status}")
        code = reply.get("code")
        if not isinstance(code, int):
            code = None
        if code in _RETRY_CODES or any(m in message for m in _RETRY_MESSAGES):
            self.rotate()
            raise _Retry(f"{endpoint}: {message}")
        if (
            authorized
            and self.user is not None
            and (code == _UNAUTHENTICATED or any(m in message for m in _BAD_TOKEN_MESSAGES))
        ):
            self._token = None  # expired or never had one: authenticate, then try again
            raise _Retry(f"{endpoint}: {message}")
        if "permission denied" in message or code == _UNAUTHENTICATED:
            raise StoreAuthError(
                f"etcd at {endpoint} refused the request: {message}"
                + ("" if self.user else " (set user= and password=)")
            )
        raise StoreError(f"etcd at {endpoint}: {message}")

    def _authenticate(self, deadline: Deadline) -> None:
        body = {"name": self.user, "password": self._password}
        try:
            reply = self._attempt("/v3/auth/authenticate", body, deadline, authorized=False)
        except StoreError as exc:
            if "password" in str(exc) or "authentication failed" in str(exc):
                raise StoreAuthError(
                    f"etcd refused the user name or password of user {self.user!r}"
                ) from None
            raise
        token = reply.get("token")
        if not isinstance(token, str) or not token:
            endpoint = self.current
            self.rotate()
            raise _Retry(f"{endpoint}: answered authentication without a token")
        self._token = token

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST path body`` on some live member, within ``timeout`` as a whole (fail-overs
        included); the decoded reply. Each attempt gets the time left shared among the members
        this lap has still to try (at most ``attempt_timeout``), so one member that holds a
        request cannot use up the time of the others."""
        deadline = Deadline(self.timeout)
        members = len(self.endpoints)
        delay, failures = 0.01, 0
        last = ""
        while True:
            untried = members - failures % members
            share = max(MIN_SHARE, min(self.attempt_timeout, deadline.left() / untried))
            attempt = deadline.within(share)
            try:
                if self.user is not None and self._token is None:
                    self._authenticate(attempt)
                return self._attempt(path, body, attempt)
            except _Retry as exc:
                last = str(exc)
            failures += 1
            if deadline.expired() or (failures % members == 0 and deadline.left() < delay):
                raise StoreConnectionError(
                    f"cannot reach etcd at {self.describe()} within {seconds(deadline.seconds)} "
                    f"(last: {last})"
                )
            if failures % members == 0:
                # Every member failed once: back off before the next lap.
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
