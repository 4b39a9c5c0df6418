"""etcd's gRPC-JSON gateway, spoken with the stdlib: requests that fail over between members.

Every call retries on another member when one cannot be reached, has no leader, or times out,
until the deadline passes; it authenticates (again) when etcd wants a token. Passwords never
appear in messages or ``repr``. ``etcd.EtcdStore`` builds the ``Store`` on it.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass
from typing import Any

from relaunch.endpoints import parse_endpoint
from relaunch.store import http1
from relaunch.store.api import StoreAuthError, StoreConnectionError, StoreError

DEFAULT_PORT = 2379
#: The longest a single attempt waits on one member before trying the next.
ATTEMPT_TIMEOUT = 5.0
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
    ) -> http1.Response:
        """Send one JSON request on ``conn``, with the token unless ``authorized`` is False."""
        headers = {"Content-Type": "application/json"}
        if authorized and self._token is not None:
            headers["Authorization"] = self._token
        return conn.post(path, json.dumps(body).encode(), headers)

    def _attempt(
        self, path: str, body: dict[str, Any], timeout: float, authorized: bool = True
    ) -> dict[str, Any]:
        """One request to the current member; ``_Retry`` when another member may do better."""
        endpoint = self.endpoints[self._current]
        try:
            if self._conn is None:
                self._conn = self.connection(endpoint, timeout)
            else:
                self._conn.timeout = timeout
            response = self.post(self._conn, path, body, authorized)
            payload = response.read()
        except (OSError, ValueError) as exc:
            self.rotate()
            raise _Retry(f"{endpoint}: {exc or type(exc).__name__}") from None
        try:
            reply: dict[str, Any] = json.loads(payload) if payload else {}
        except ValueError:
            self.rotate()
            raise _Retry(
                f"{endpoint}: answered HTTP {response.status} with a body that is "
                "not JSON (is this an etcd v3 client port?)"
            ) from None
        if response.status == 200 and "error" not in reply:
            return reply
        message = str(reply.get("message") or reply.get("error") or f"HTTP {response.status}")
        code = reply.get("code")
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

    def _authenticate(self, timeout: float) -> None:
        body = {"name": self.user, "password": self._password}
        try:
            reply = self._attempt("/v3/auth/authenticate", body, timeout, authorized=False)
        except StoreError as exc:
            if "password" in str(exc) or "authentication failed" in str(exc):
                raise StoreAuthError(
                    f"etcd refused the user name or password of user {self.user!r}"
                ) from None
            raise
        self._token = str(reply["token"])

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST path body`` on some live member, within ``timeout``; the decoded reply."""
        deadline = time.monotonic() + self.timeout
        delay, failures = 0.01, 0
        last = ""
        while True:
            left = deadline - time.monotonic()
            attempt_timeout = max(0.05, min(left, ATTEMPT_TIMEOUT))
            try:
                if self.user is not None and self._token is None:
                    self._authenticate(attempt_timeout)
                return self._attempt(path, body, attempt_timeout)
            except _Retry as exc:
                last = str(exc)
            failures += 1
            if failures % len(self.endpoints) == 0:
                # Every member failed once: back off before the next lap.
                if time.monotonic() + delay > deadline:
                    raise StoreConnectionError(
                        f"cannot reach etcd at {self.describe()} within {self.timeout:g}s "
                        f"(last: {last})"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
