"""Prometheus metrics of one agent (``--metrics-port [ADDR:]PORT``): the values, and a small HTTP
server on a daemon thread that answers ``GET /metrics``.

The agent counts what happens (``restarted``, ``joined``); the rest is read when Prometheus
scrapes, from what the agent already keeps: its group's state, its workers' processes, the
``NodeReporter``'s status (steps, rates and signs of life, read from the shared-memory
channel) and the last job view it saw (stragglers), and the time its last status write to the
store took. A scrape never touches the store, and adds no load to it.

The server is hand-written (``socket``): ``http.server`` would add about 30 ms to the
agent's start, and ``prometheus_client`` about 50 ms. One connection at a time, each given
``READ_TIMEOUT`` seconds to send its request; the answer closes the connection.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from relaunch.agent.spec import WorkerGroup, WorkerState
from relaunch.agent.status import NodeReporter
from relaunch.core import metrics as core
from relaunch.core.status import RankStatus
from relaunch.procs.context import PContext

if TYPE_CHECKING:
    import socket

log = logging.getLogger(__name__)

#: Seconds a client has to send its request before the connection is dropped.
READ_TIMEOUT = 2.0
#: The most bytes of a request read (its request line and headers).
MAX_REQUEST = 16384


class AgentMetrics:
    """The values one agent serves: counters it is told of, and probes read at each scrape."""

    def __init__(
        self,
        group: WorkerGroup,
        reporter: NodeReporter,
        pcontext: Callable[[], PContext | None],
        restarts_used: Callable[[], int],
    ) -> None:
        self._group = group
        self._reporter = reporter
        self._pcontext = pcontext
        self._restarts_used = restarts_used
        self._lock = threading.Lock()
        self._restarts = dict.fromkeys(core.RESTART_CAUSES, 0)
        self._rounds = 0
        self._durations = core.Histogram()
        self._server: MetricsServer | None = None

    # -- what the agent tells --------------------------------------------------------------------

    def restarted(self, cause: str) -> None:
        """The group restarts, for ``cause`` (one of ``core.metrics.RESTART_CAUSES``)."""
        with self._lock:
            self._restarts[cause or "unknown"] = self._restarts.get(cause or "unknown", 0) + 1

    def joined(self, seconds: float) -> None:
        """The agent joined a rendezvous round, after ``seconds``."""
        with self._lock:
            self._rounds += 1
            self._durations.observe(seconds)

    # -- serving ---------------------------------------------------------------------------------

    def bind(self, host: str, port: int) -> int:
        """Bind the server to ``host:port`` (host "": every interface; port 0: a free one) and
        return the port; ``ConfigError`` when that cannot be. Serving starts with ``start``."""
        self._server = MetricsServer(host, port, self.render)
        return self._server.port

    def start(self) -> None:
        if self._server is not None:
            self._server.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    # -- a scrape --------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The exposition of the values now."""
        return core.exposition(self.families(time.time())).encode()

    def families(self, now: float) -> list[core.Family]:
        """Every metric of ``core.metrics.CATALOGUE``, sampled at ``now`` (``time.time()``)."""
        group, spec = self._group, self._group.spec
        handler = spec.rdzv_handler
        node = getattr(handler, "identity", "") or os.uname().nodename
        base: core.Labels = (("run_id", handler.get_run_id()), ("node", node))
        with self._lock:
            restarts = dict(self._restarts)
            rounds = self._rounds
            durations = self._durations.samples(base)
        status = self._reporter.status()
        view = self._reporter.view
        slow = set() if view is None else set(view.stragglers)
        states = self._worker_states()
        ranks = [] if status is None else status.ranks
        at = str(group.group_rank if group.group_rank is not None else "")

        def labels(rank: RankStatus) -> core.Labels:
            where = (("rank", str(rank.rank)), ("local_rank", str(rank.local_rank)))
            return (*base, ("group_rank", at), *where)

        def per_rank(value: Callable[[RankStatus], float | None]) -> list[core.Sample]:
            got = [(rank, value(rank)) for rank in ranks]
            return [core.Sample(labels(rank), v) for rank, v in got if v is not None]

        worker_states = [
            sample
            for rank in ranks
            for sample in core.enum_samples(
                labels(rank), core.WORKER_STATES, states.get(rank.local_rank, "running")
            )
        ]
        info = (*base, ("role", spec.role), ("backend", handler.get_backend()))
        rtt = self._reporter.store_round_trip
        return [
            core.Family("relaunch_agent_info", [core.Sample(info, 1)]),
            core.Family(
                "relaunch_group_state",
                core.enum_samples(base, [s.value for s in WorkerState], group.state.value),
            ),
            core.Family(
                "relaunch_group_rank",
                [] if group.group_rank is None else [core.Sample(base, group.group_rank)],
            ),
            core.Family(
                "relaunch_group_world_size",
                []
                if group.group_world_size is None
                else [core.Sample(base, group.group_world_size)],
            ),
            core.Family("relaunch_worker_state", worker_states),
            core.Family(
                "relaunch_group_restarts_total",
                [core.Sample((*base, ("cause", c)), n) for c, n in restarts.items()],
            ),
            core.Family("relaunch_restarts_used", [core.Sample(base, self._restarts_used())]),
            core.Family("relaunch_max_restarts", [core.Sample(base, spec.max_restarts)]),
            core.Family("relaunch_rendezvous_rounds_total", [core.Sample(base, rounds)]),
            core.Family("relaunch_rendezvous_duration_seconds", durations),
            core.Family("relaunch_rank_step", per_rank(lambda r: r.step)),
            core.Family("relaunch_rank_total_steps", per_rank(lambda r: r.total)),
            core.Family("relaunch_rank_steps_per_second", per_rank(lambda r: r.rate)),
            core.Family(
                "relaunch_rank_seconds_since_last_sign",
                per_rank(lambda r: None if r.last_sign is None else max(0.0, now - r.last_sign)),
            ),
            core.Family(
                "relaunch_rank_straggler",
                per_rank(lambda r: 1.0 if r.rank in slow else 0.0),
            ),
            core.Family(
                "relaunch_store_round_trip_seconds",
                [] if rtt is None else [core.Sample(base, rtt)],
            ),
        ]

    def _worker_states(self) -> dict[int, str]:
        """Each local rank's state (``core.metrics.WORKER_STATES``)."""
        pcontext = self._pcontext()
        if pcontext is None:
            return {}
        running = pcontext.running()
        outcome = pcontext.wait(0)
        states = {}
        for worker in self._group.workers:
            local = worker.local_rank
            if local in running:
                states[local] = "running"
            elif outcome is None:
                states[local] = "exited"
            elif local in outcome.failures:
                states[local] = "failed"
            elif local in outcome.stopped:
                states[local] = "stopped"
            else:
                states[local] = "succeeded"
        return states


class MetricsServer:
    """Answers ``GET /metrics`` with ``render()``, from a daemon thread; bound at construction."""

    def __init__(self, host: str, port: int, render: Callable[[], bytes]) -> None:
        import socket  # here: an agent without metrics loads no network code

        from relaunch.config import ConfigError

        self._render = render
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if host:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self._sock = socket.create_server((host, port), family=family)
            elif socket.has_dualstack_ipv6():
                self._sock = socket.create_server(
                    ("", port), family=socket.AF_INET6, dualstack_ipv6=True
                )
            else:
                self._sock = socket.create_server(("", port))
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {where}: cannot serve metrics there "
                f"({os.strerror(exc.errno) if exc.errno else exc}); give another port"
            ) from None
        self.port: int = self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        self._closed = False
        log.info("serving Prometheus metrics on %s:%d/metrics", host or "*", self.port)

    def start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._serve, name="relaunch-metrics", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        """Stop serving; an answer being written is finished first."""
        import socket

        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() (Linux)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(READ_TIMEOUT + 1)
        self._sock.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    log.debug("a metrics client went away", exc_info=True)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT)
        request = b""
        while b"\r\n\r\n" not in request and b"\n\n" not in request:
            chunk = conn.recv(4096)
            if not chunk or len(request) > MAX_REQUEST:
                break
            request += chunk
        method, _, rest = request.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        content_type = "text/plain; charset=utf-8"
        if method not in (b"GET", b"HEAD"):
            status, body = "405 Method Not Allowed", b"GET /metrics\n"
        elif path == b"/metrics":
            try:
                status, body, content_type = "200 OK", self._render(), core.CONTENT_TYPE
            except Exception:  # a scrape must never end the agent; the next one may do
                log.debug("rendering the metrics failed", exc_info=True)
                status, body = "500 Internal Server Error", b"the metrics are not readable now\n"
        elif path == b"/":
            status, body = "200 OK", b"relaunch agent: metrics at /metrics\n"
        else:
            status, body = "404 Not Found", b"not found: metrics are at /metrics\n"
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        conn.sendall(head if method == b"HEAD" else head + body)
