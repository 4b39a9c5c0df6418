"""torchft's lighthouse for replica groups on several nodes: one node of the job runs it, beside
the job's store, and every node's workers reach it through a relay on their own node.

Each node's agent (of whichever group) starts a ``LighthouseRelay`` that follows the job's key
``relaunch/<job>/lighthouse`` (the job's run id, not a group's: every group finds the same
one), and its workers get ``TORCHFT_LIGHTHOUSE=http://127.0.0.1:<relay port>``. Which node runs
the lighthouse and writes its ``HOST:PORT`` under that key:

- the built-in store (c10d): the node that hosts the store, on the store's address; when the
  store moves to a standby (docs/store-failover.md), the node it moved to starts one, and the
  relays follow the key there (it was replicated with the store);
- etcd (no node hosts it): the node that creates the key on a lease of its own (the
  rendezvous' detection time), renewed while it lives; when that node is lost, etcd deletes
  the key with the lease, every other node sees it go, and the first to create it again runs
  the next lighthouse.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import relaunch.core.run.lighthouse as decide
from relaunch.agent.lighthouse import Lighthouse, LighthouseError, torchft_importable
from relaunch.agent.lighthouse_relay import STORE_RETRY, WATCH_SLICE, LighthouseRelay
from relaunch.rendezvous.kinds import StoreSeat
from relaunch.rendezvous.rounds import job_key
from relaunch.runtime import start_thread
from relaunch.store.api import Store, StoreError

if TYPE_CHECKING:
    from relaunch.store.etcd import EtcdStore

log = logging.getLogger(__name__)


def start_on_nodes(
    handler: object,
    job_run_id: str,
    replica_groups: int,
    environ: Mapping[str, str],
    log_dir: str | None,
    say: Callable[[str], None],
) -> tuple[dict[str, str], Callable[[], None]]:
    """This node's part of the lighthouse of a job of ``replica_groups`` groups on several
    nodes (``job_run_id``: the job's ``--rdzv-id``, every group's), when the job wants one
    (``decide.wants_lighthouse``) and its rendezvous has a shared store: what every worker
    gets (the relay's address, ``worker_defaults``) and how to stop it all; nothing otherwise.
    The lighthouse logs to ``log_dir/lighthouse.log`` (None: a folder of its own, made when it
    starts here)."""
    seat: StoreSeat | None = getattr(handler, "seat", None)
    if seat is None or not decide.wants_lighthouse(environ, torchft_importable(), replica_groups):
        return {}, _nothing
    settings, wrong = decide.settings_from(environ)
    for line in wrong:
        say(line)
    key = job_key(job_run_id, decide.KEY_NAME)
    node = NodeLighthouse(seat, key, settings, log_dir, say)
    extra = node.start()
    say(
        f"torchft's lighthouse: this node's workers reach it through {extra[decide.ADDRESS_VAR]} "
        f"(a relay to where the job's store says it runs: {key})"
    )
    return {**extra, **decide.worker_defaults(environ)}, node.close


def _nothing() -> None:
    pass


class NodeLighthouse:
    """One node's relay to the job's lighthouse, and the lighthouse itself while this node is
    the one to run it (``seat``: the store's host, or the holder of the key's lease)."""

    def __init__(
        self,
        seat: StoreSeat,
        key: str,
        settings: decide.LighthouseSettings,
        log_dir: str | None,
        say: Callable[[str], None] = log.warning,
    ) -> None:
        self._seat, self._key, self._settings = seat, key, settings
        self._log_dir, self._say = log_dir, say
        self.relay = LighthouseRelay()
        self.lighthouse: Lighthouse | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._lease: int | None = None  # etcd: the lease the key hangs on, while held here
        self._store: Store | None = None  # this node's own connection, for the key's writes
        self._followed: Store | None = None  # the relay's, which watches the key

    def start(self) -> dict[str, str]:
        """Relay from now on, run the lighthouse when it is this node's; what workers get."""
        self.relay.start()
        self._followed = self._seat.connect()
        self.relay.follow(self._followed, self._key)
        self._store = self._seat.connect()
        self._seat.at_shutdown(self._leave)  # before the store: a hosted one ends with it
        if self._seat.hosted:
            self._seat.on_move(self._moved)
            self._run_if_host()
        else:
            start_thread(self._claim, "lighthouse's lease")
        return {decide.ADDRESS_VAR: self.relay.address}

    def close(self) -> None:
        """Stop the lighthouse (if here) and the relay; the key's lease goes at once."""
        self._leave()
        self._stop_lighthouse()

    def _leave(self) -> None:
        """Stop relaying, and the lighthouse too unless the store it runs beside serves on past
        the rendezvous for the other groups (``StoreSeat.kept``; ``close`` stops it then).
        Once."""
        if self._closed.is_set():
            return
        self._closed.set()
        if not self._seat.kept:
            self._stop_lighthouse()
        self._let_go()
        self.relay.close()
        from relaunch.store.client import TcpStore

        for store in (self._followed, self._store):
            if isinstance(store, TcpStore):  # its watch ends now (etcd's, within WATCH_SLICE)
                store.interrupt()
                store.close()

    # -- the built-in store: the node that hosts it runs it ------------------------------------

    def _moved(self) -> None:
        """The store moved: to this node, maybe (started off the thread that moved it)."""
        start_thread(self._run_if_host, "lighthouse's start")

    def _run_if_host(self) -> None:
        host = self._seat.host_here()
        if host is not None and self.lighthouse is None:
            self._run(host, lease=0)

    # -- etcd: the node that holds the key's lease runs it -------------------------------------

    def _claim(self) -> None:
        """Watch the key; whenever nobody holds it, try to take it on a lease, and while this
        node holds it, run the lighthouse and renew the lease."""
        store = self._etcd()
        version, said = -1, None
        while not self._closed.is_set():
            try:
                current = (
                    store.get(self._key)
                    if version < 0
                    else store.watch(self._key, version, WATCH_SLICE)
                )
                version = current.version
                if current.value is None and self._take(store):
                    self._hold(store)
                    version = -1
            except StoreError as exc:
                if self._closed.is_set():
                    return
                if said != str(exc):
                    log.warning("the lighthouse's lease: the store failed: %s", exc)
                    said = str(exc)
                version = -1
                self._closed.wait(STORE_RETRY)

    def _etcd(self) -> EtcdStore:
        from relaunch.store.etcd import EtcdStore

        assert isinstance(self._store, EtcdStore)  # the one store no node hosts
        return self._store

    def _take(self, store: EtcdStore) -> bool:
        """Create the key on a new lease of this node's (empty: the relays forward nothing
        yet), unless another node did first; whether this node holds it now."""
        from relaunch.store import etcd_shapes as shapes

        lease = store.grant_lease(self._seat.lease_ttl)
        taken = store.txn(
            [shapes.absent(self._key)],
            [{"request_put": shapes.put_request(self._key, b"", lease)}],
            [],
        ).succeeded
        if not taken:
            store.revoke_lease(lease)
            return False
        self._lease = lease
        if self._run(self._seat.local_addr, lease) is None:
            self._let_go()
            return False
        return True

    def _hold(self, store: EtcdStore) -> None:
        """Renew the lease three times a lease, until it is lost (the lighthouse stops here:
        another node may run one now) or ``close``."""
        while not self._closed.wait(self._seat.lease_ttl / 3):
            lease = self._lease
            if lease is None or not store.keep_alive(lease):
                self._say(
                    "torchft's lighthouse: this node lost its lease on the job's key: its "
                    "lighthouse stops, another node's takes over"
                )
                self._lease = None
                self._stop_lighthouse()
                return

    def _stop_lighthouse(self) -> None:
        with self._lock:
            lighthouse, self.lighthouse = self.lighthouse, None
        if lighthouse is not None:
            lighthouse.close()

    def _let_go(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            self._etcd().revoke_lease(lease)
        except StoreError:
            pass  # it lapses by itself

    # -- either ------------------------------------------------------------------------------

    def _run(self, host: str, lease: int) -> Lighthouse | None:
        """Start the lighthouse on ``host`` and write where it listens under the key (on
        ``lease`` when not 0); None when it could not start (said)."""
        with self._lock:
            if self._closed.is_set() or self.lighthouse is not None:
                return self.lighthouse
            if self._log_dir is None:
                import tempfile

                from relaunch.procs.logs_specs import TEMP_PREFIX

                self._log_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
            log_path = os.path.join(self._log_dir, "lighthouse.log")
            lighthouse = Lighthouse(
                self._settings,
                log_path,
                host,
                self._say,
                on_move=lambda port: self._announce(host, port, lease),
            )
            try:
                lighthouse.start()
            except LighthouseError as exc:
                self._say(str(exc))
                return None
            self.lighthouse = lighthouse
        self._announce(host, lighthouse.port, lease)
        self._say(
            f"torchft's lighthouse for the job runs on this node: {lighthouse.address} (kept "
            f"alive; its log: {lighthouse.log_path})"
        )
        return lighthouse

    def _announce(self, host: str, port: int | None, lease: int) -> None:
        """Write where this node's lighthouse listens under the key (on ``lease`` when not 0):
        ``host:port``, or nothing while it restarts (None: the relays forward nothing)."""
        assert self._store is not None
        value = b"" if port is None else decide.announcement(host, port)
        try:
            if lease:
                self._etcd().set(self._key, value, lease=lease)
            else:
                self._store.set(self._key, value)
        except StoreError as exc:
            self._say(f"torchft's lighthouse: the store did not take its address: {exc}")
