"""etcd's gRPC-JSON gateway, spoken with the stdlib: requests that fail over between members.

Every call retries on another member when one cannot be reached, has no leader, or times out,
until the deadline passes; it authenticates (again) when etcd wants a token. The deadline is the
call's as a whole (``deadline.Deadline``): each attempt gets a share of what is left, so that a
member that answers a byte at a time is left for the next one in time, and the call ends by its
deadline whatever the members do. A streaming watch (``WatchStream``) holds a connection of its
own. Passwords never appear in messages or ``repr``. ``etcd.EtcdStore`` builds the ``Store`` on
it; what is sent and read is in ``etcd_shapes``.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import relaunch.store.http1 as http1
from relaunch.core.durations import seconds
from relaunch.endpoints import parse_endpoint
from relaunch.runtime import SYSTEM_CLOCK, Clock
from relaunch.store.api import StoreAuthError, StoreConnectionError, StoreError
from relaunch.store.deadline import Deadline
from relaunch.store.etcd_shapes import malformed, watch_result
from relaunch.store.retry import Backoff

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


class _Retry(Exception):
    """This attempt failed in a way another attempt (on another member) may not."""


class Gateway:
    """Requests to the etcd cluster at ``endpoints``, each within ``timeout`` seconds (kept on
    ``clock``).

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
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self._clock = clock
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
        deadline = Deadline(self.timeout, self._clock)
        backoff = Backoff(deadline.at, self._clock)  # between laps: every member failed once
        members = len(self.endpoints)
        failures = 0
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
            lap_ended = failures % members == 0
            if deadline.expired() or (lap_ended and not backoff.pause()):
                raise StoreConnectionError(
                    f"cannot reach etcd at {self.describe()} within {seconds(deadline.seconds)} "
                    f"(last: {last})"
                )


class WatchStream:
    """One streaming watch, open on a connection of its own (``EtcdStore.open_watch``)."""

    def __init__(
        self,
        conn: http1.Connection,
        response: http1.Response,
        endpoint: Endpoint,
        member_failed: Callable[[Endpoint], None],
    ) -> None:
        self._conn, self._response = conn, response
        self._endpoint, self._member_failed = endpoint, member_failed
        self.compacted = False  # whether it ended behind a compaction

    @property
    def endpoint(self) -> Endpoint:
        """The member the stream is on."""
        return self._endpoint

    def results(self) -> Iterator[dict[str, Any] | None]:
        """The stream's results (the first says it was created), and None each time a read
        waited the connection's timeout in vain. The iteration ends when the stream breaks,
        is cancelled or falls behind a compaction (``compacted``); a member that died under it
        is reported to ``member_failed`` (the store's next request goes to another)."""
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
                result = watch_result(line)
                if result is None:
                    return
                if int(result.get("compact_revision", 0)):
                    self.compacted = True
                    return
                if result.get("canceled"):
                    return
                yield result
        except (OSError, ValueError):
            if not self._conn.interrupted:
                self._member_failed(self._endpoint)

    def interrupt(self) -> None:
        """Wake a thread reading the stream (from another thread): its ``results`` end."""
        self._conn.interrupt()

    def close(self) -> None:
        self._conn.close()
