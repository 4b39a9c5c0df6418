"""Real etcd clusters for tests: members on free loopback ports, optionally with TLS and auth.

Needs the ``etcd`` binary (``make test`` installs Debian's etcd-server) and, for TLS, ``openssl``.
Everything is reached through etcd's v3 gRPC-JSON gateway with the standard library only: keys and
values are base64 in its JSON, and int64 fields are strings.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any

from relaunch.endpoints import find_free_port

MARK_VAR = "RELAUNCH_TEST_MARK"
HOST = "127.0.0.1"
START_TIMEOUT = 20.0
START_ATTEMPTS = 3


class _PortClash(Exception):
    """A port picked as free was taken before etcd bound it: start again with other ports."""


def b64(text: str | bytes) -> str:
    """Base64 of ``text``, as the gateway's JSON wants keys and values."""
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free on loopback a moment ago."""
    ports: list[int] = []
    while len(ports) < count:
        port = find_free_port(HOST)
        if port not in ports:
            ports.append(port)
    return ports


def _clean_env() -> dict[str, str]:
    """The environment for etcd: no test mark (members may outlive a test) and no ETCD_* flags."""
    return {
        name: value
        for name, value in os.environ.items()
        if name != MARK_VAR and not name.startswith("ETCD_")
    }


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the thread that started it dies, so that no
    member outlives a test run killed outright (a fixture's finalizer then never runs)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(file.readlines()[-lines:])
    except OSError as exc:
        return f"<no log: {exc}>"


class EtcdCluster:
    """``size`` etcd members on loopback, each with its own data dir under one temp dir."""

    def __init__(
        self, size: int = 1, *, tls: bool = False, auth: tuple[str, str] | None = None
    ) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self.tls = tls
        self.auth = auth
        self.protocol = "https" if tls else "http"
        self.client_ports: list[int] = []
        self.peer_ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir = ""
        self.cacert = ""
        self.cert = ""
        self.key = ""
        self._ssl: ssl.SSLContext | None = None

    # -- addresses -----------------------------------------------------------------------------

    @property
    def endpoint_list(self) -> list[str]:
        """``host:port`` of each member's client URL, no scheme."""
        return [f"{HOST}:{port}" for port in self.client_ports]

    @property
    def endpoints(self) -> str:
        """The client endpoints joined by commas: ``127.0.0.1:p1,127.0.0.1:p2``."""
        return ",".join(self.endpoint_list)

    @property
    def urls(self) -> list[str]:
        """Each member's client URL, with the scheme."""
        return [f"{self.protocol}://{endpoint}" for endpoint in self.endpoint_list]

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def log_path(self, i: int) -> str:
        return os.path.join(self.dir, f"m{i}.log")

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> EtcdCluster:
        """Start all members and wait until each is healthy (and auth is on, if asked)."""
        if self.procs:
            raise RuntimeError("cluster already started")
        self.dir = tempfile.mkdtemp(prefix="relaunch-etcd-")
        try:
            if self.tls:
                self._make_certs()
            for attempt in range(START_ATTEMPTS):
                try:
                    self._start_members()
                    break
                except _PortClash:
                    self._kill_members()
                    if attempt == START_ATTEMPTS - 1:
                        raise RuntimeError(
                            f"etcd: ports taken on {START_ATTEMPTS} tries\n{self._logs()}"
                        ) from None
            if self.auth is not None:
                self._enable_auth(*self.auth)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` and reap it; the others keep running."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def stop(self) -> None:
        """SIGTERM all live members, SIGKILL any left after 5 s, reap them, remove the temp dir.

        The leader goes last, once it sees its peers gone: a leader stopped while it still
        thinks a peer is up spends ~6 s trying to hand its leadership over to it.
        """
        deadline = time.monotonic() + 5.0
        leader = self.leader() if self.size > 1 else None
        self._terminate([proc for i, proc in enumerate(self.procs) if i != leader], deadline)
        if leader is not None:
            delay = 0.005
            while not self._alone(leader) and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            self._terminate([self.procs[leader]], deadline)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __enter__(self) -> EtcdCluster:
        return self if self.procs else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- talking to the gateway ----------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext | None:
        """For ``https``: trusts the test CA and presents the client certificate."""
        if not self.tls:
            return None
        if self._ssl is None:
            context = ssl.create_default_context(cafile=self.cacert)
            context.load_cert_chain(self.cert, self.key)
            self._ssl = context
        return self._ssl

    def call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        member: int = 0,
        token: str | None = None,
        timeout: float = 2.0,
    ) -> dict[str, Any]:
        """POST ``body`` as JSON to ``path`` (e.g. ``/v3/kv/put``) on ``member``; the JSON reply.

        Raises ``urllib.error.HTTPError`` for an error status (its body holds etcd's error JSON).
        """
        request = urllib.request.Request(
            self.urls[member] + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        if token is not None:
            request.add_header("Authorization", token)
        with urllib.request.urlopen(request, timeout=timeout, context=self.ssl_context()) as reply:
            result: dict[str, Any] = json.loads(reply.read() or b"{}")
            return result

    def authenticate(self, member: int = 0) -> str:
        """A token for the ``auth`` user, to send as the ``Authorization`` header."""
        if self.auth is None:
            raise RuntimeError("this cluster has no auth")
        name, password = self.auth
        reply = self.call(
            "/v3/auth/authenticate", {"name": name, "password": password}, member=member
        )
        token: str = reply["token"]
        return token

    def healthy(self, i: int, timeout: float = 0.5) -> bool:
        """True if member ``i`` answers ``/health`` with ``{"health": "true"}``."""
        try:
            with urllib.request.urlopen(
                self.urls[i] + "/health", timeout=timeout, context=self.ssl_context()
            ) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def leader(self) -> int | None:
        """The index of the member that leads now, if a live one says it does (else None)."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                continue
            try:
                status = self.call("/v3/maintenance/status", member=i, timeout=0.5)
            except (OSError, ValueError):
                continue
            if status.get("leader") == status.get("header", {}).get("member_id"):
                return i
        return None

    # -- internals -----------------------------------------------------------------------------

    def _start_members(self) -> None:
        self._kill_members()
        ports = _free_ports(2 * self.size)
        self.client_ports, self.peer_ports = ports[: self.size], ports[self.size :]
        token = uuid.uuid4().hex
        peers = [f"http://{HOST}:{port}" for port in self.peer_ports]
        initial = ",".join(f"m{i}={url}" for i, url in enumerate(peers))
        env = _clean_env()
        deadline = time.monotonic() + START_TIMEOUT
        for i in range(self.size):
            data_dir = os.path.join(self.dir, f"m{i}.etcd")
            shutil.rmtree(data_dir, ignore_errors=True)
            args = [
                "etcd",
                "--name",
                f"m{i}",
                "--data-dir",
                data_dir,
                "--listen-client-urls",
                self.urls[i],
                "--advertise-client-urls",
                self.urls[i],
                "--listen-peer-urls",
                peers[i],
                "--initial-advertise-peer-urls",
                peers[i],
                "--initial-cluster",
                initial,
                "--initial-cluster-token",
                token,
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
            ]
            if self.tls:
                args += [
                    "--cert-file",
                    os.path.join(self.dir, "server.crt"),
                    "--key-file",
                    os.path.join(self.dir, "server.key"),
                    "--trusted-ca-file",
                    self.cacert,
                    "--client-cert-auth",
                ]
            with open(self.log_path(i), "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        args,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        preexec_fn=_die_with_parent,
                    )
                )
            # One at a time: a new member asks the others whether it already joined, and one
            # that listens on its peer port but does not serve yet keeps it waiting 1 s.
            if i < self.size - 1:
                self._wait_members([i], self._serves_peers, "serving peers", deadline)
        self._wait_members(list(range(self.size)), self.healthy, "healthy", deadline)

    def _terminate(self, procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
        """SIGTERM ``procs`` and wait for them until ``deadline``."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _alone(self, i: int) -> bool:
        """True if member ``i`` has exited, leads no more, or sees no active peer (or can't say)."""
        if self.procs[i].poll() is not None:
            return True
        try:
            with urllib.request.urlopen(
                self.urls[i] + "/metrics", timeout=0.5, context=self.ssl_context()
            ) as reply:
                metrics = reply.read().decode().splitlines()
        except (OSError, ValueError):
            return True
        active = sum(
            float(line.rsplit(None, 1)[1])
            for line in metrics
            if line.startswith("etcd_network_active_peers{")
        )
        return active == 0 or "etcd_server_is_leader 0" in metrics

    def _serves_peers(self, i: int) -> bool:
        """True once member ``i`` answers HTTP on its peer port."""
        try:
            with urllib.request.urlopen(
                f"http://{HOST}:{self.peer_ports[i]}/version", timeout=0.2
            ) as reply:
                return reply.status == 200
        except (OSError, ValueError):
            return False

    def _wait_members(
        self, members: list[int], ready: Callable[[int], bool], what: str, deadline: float
    ) -> None:
        """Wait until ``ready(i)`` for each of ``members``; a member that exits fails the start."""
        waiting = set(members)
        delay = 0.005
        while waiting:
            for i in sorted(waiting):
                if self.procs[i].poll() is not None:
                    log = _tail(self.log_path(i))
                    if "address already in use" in log:
                        raise _PortClash
                    raise RuntimeError(
                        f"etcd member m{i} exited with {self.procs[i].returncode}:\n{log}"
                    )
                if ready(i):
                    waiting.discard(i)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd members {sorted(waiting)} not {what} after {START_TIMEOUT}s\n"
                    + self._logs()
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _enable_auth(self, user: str, password: str) -> None:
        """Make ``user`` a user with the role root (which needs no adding), then turn auth on.

        etcd refuses to turn auth on without a user named root: for another ``user`` the root
        user gets a random password nobody knows.
        """
        users = {user: password}
        if user != "root":
            users["root"] = uuid.uuid4().hex
        for name, secret in users.items():
            self.call("/v3/auth/user/add", {"name": name, "password": secret})
            self.call("/v3/auth/user/grant", {"user": name, "role": "root"})
        self.call("/v3/auth/enable", {})

    def _make_certs(self) -> None:
        d = self.dir
        self.cacert = os.path.join(d, "ca.crt")
        self.cert = os.path.join(d, "client.crt")
        self.key = os.path.join(d, "client.key")
        with open(os.path.join(d, "server.ext"), "w") as file:
            file.write(
                "basicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth,clientAuth\n"
                "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            )
        with open(os.path.join(d, "client.ext"), "w") as file:
            file.write(
                "basicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=clientAuth\n"
            )
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl(
            "req",
            "-x509",
            *key,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=relaunch-test-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        )
        # The client certificate has no CN: with auth on, etcd's gateway answers 400 to a client
        # certificate with a CN ("CommonName of client ... will be ignored"). No CN is a user.
        for name, subject in (("server", "/CN=relaunch-test-server"), ("client", "/O=relaunch")):
            self._openssl(
                "req",
                *key,
                "-keyout",
                f"{name}.key",
                "-out",
                f"{name}.csr",
                "-subj",
                subject,
            )
            self._openssl(
                "x509",
                "-req",
                "-in",
                f"{name}.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-set_serial",
                str(uuid.uuid4().int >> 64),
                "-days",
                "2",
                "-extfile",
                f"{name}.ext",
                "-out",
                f"{name}.crt",
            )

    def _openssl(self, *args: str) -> None:
        result = subprocess.run(
            ["openssl", *args], cwd=self.dir, capture_output=True, text=True, env=_clean_env()
        )
        if result.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stderr}")

    def _kill_members(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self.procs = []

    def _logs(self) -> str:
        return "\n".join(
            f"--- m{i} log tail ---\n{_tail(self.log_path(i))}" for i in range(self.size)
        )
