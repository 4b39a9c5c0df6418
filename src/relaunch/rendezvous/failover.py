"""The built-in store outlives its host (docs/store-failover.md): one node's part.

Failover is on when ``--rdzv-endpoint`` names several hosts. An agent starting asks them which
one serves the job (``find_primary``); when none does, the agent that can bind the first one
serves the job's store (the primary), as with one endpoint. Every other agent that can bind one
of the named addresses serves a standby there, which follows the primary's every change
(``TcpStoreServer.follow``) and redirects clients to it. Every node knows the standbys without
asking: the named hosts, in the order given.

When the primary is lost (refused: its agent died; silent: its machine is gone), each surviving
node asks the first named standby that answers to take over (``PROMOTE``), naming itself by the
last round it completed and its group rank in it. The standby counts the votes by itself
(``job_electorate``): it takes over once a majority of the members of the last round completed
in its copy of the store ask at once, and a vote from anyone else counts for nothing. Then
every node moves its connections there (``TcpStore.move_to``) and the job re-forms without the
lost node, keeping the restart budget, the exclusion records and the learned bounds (all
replicated). Failover needs a token: without one, anyone could follow a store or vote.

The primary's side of a partition: ``MajorityWatch`` fences the store (it answers ``FENCED``)
once fewer than a majority of the running round's members beat into it for half the keep-alive
detection time, so two stores never both run the job.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from relaunch.core.durations import seconds
from relaunch.endpoints import parse_endpoint
from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread
from relaunch.store.api import (
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreFenced,
    StoreRedirect,
    StoreRefused,
)
from relaunch.store.client import TcpStore
from relaunch.store.deadline import Deadline
from relaunch.store.replication import Elect, Electorate

if TYPE_CHECKING:
    from relaunch.core.rendezvous import rounds as plan
    from relaunch.store.server import TcpStoreServer

log = logging.getLogger(__name__)

Endpoint = tuple[str, int]

#: A key nobody writes: reading it tells a primary (it answers) from a standby (it redirects).
_PROBE_KEY = "relaunch/\0primary?"


def majority(members: int) -> int:
    """How many of ``members`` nodes are a majority."""
    return members // 2 + 1


def quorum_needed(members: int, previous: Sequence[int]) -> int:
    """How many of a running round's ``members`` (the primary's node included) must beat into
    the primary for it to go on serving, ``previous`` holding the size of the round before it
    if known; 0 when nothing elsewhere can take over. A round of 3 or more needs its own
    majority. A round after one of 3 or more also needs that round's majority: the other side
    of a partition may promote a standby with a majority of the last round, so a smaller round
    formed here (an ``--nnodes`` minimum low enough) must not run the job beside it."""
    needed = majority(members) if members >= 3 else 0
    if previous and previous[-1] >= 3:
        needed = max(needed, majority(previous[-1]))
    return needed


def voter_name(round_: int, group_rank: int, run_id: str | None = None) -> str:
    """How a member of round ``round_`` of group rank ``group_rank`` names itself voting; a
    replica group's member also names its group's rendezvous, ``run_id``
    (``failover_groups``)."""
    return f"{round_}/{group_rank}" if run_id is None else f"{round_}/{group_rank}@{run_id}"


def job_electorate(run_id: str) -> Elect:
    """Who may vote a standby of job ``run_id`` into its primary's place, read from the
    standby's copy of the store: the members of the last round completed in it, a majority of
    them at once. Nobody before a round completed, or once the job finished. A replica group's
    rendezvous (``RUN_ID-group{g}``) votes with every group of its job
    (``failover_groups.groups_electorate``)."""
    from relaunch.core.run.replica_groups import job_of_group
    from relaunch.rendezvous.failover_groups import Members, groups_electorate, last_round

    job = job_of_group(run_id)
    if job is not None:
        return groups_electorate(job, run_id, majority)

    def elect(read: Callable[[str], bytes | None]) -> Electorate | None:
        last = last_round(read, run_id)
        if last is None:
            return None
        return Electorate(Members({"": last}), majority(last[1]))

    return elect


def _reach(endpoint: Endpoint, within: float) -> None:
    """Whether something listens at ``endpoint``, in one attempt (a refusal is known at once,
    where ``TcpStore`` would retry): ``StoreRefused`` or ``StoreConnectionError`` if not."""
    try:
        socket.create_connection(endpoint, timeout=within).close()
    except ConnectionRefusedError:
        raise StoreRefused(f"nothing listens at {format_endpoint(endpoint)}") from None
    except OSError as exc:
        raise StoreConnectionError(f"cannot reach {format_endpoint(endpoint)}: {exc}") from None


def _answers(endpoint: Endpoint, within: float) -> bool:
    try:
        _reach(endpoint, within)
    except StoreError:
        return False
    return True


def find_primary(
    endpoints: Sequence[Endpoint], token: str | None, within: float = 1.0
) -> Endpoint | None:
    """The named endpoint whose store serves the job now (a standby redirects: not it), or None
    when none does. ``StoreAuthError`` when one refuses the token: the flags are wrong."""
    for endpoint in endpoints:
        if not _answers(endpoint, within):
            continue
        try:
            with TcpStore(*endpoint, token, timeout=within, connect_timeout=within) as store:
                store.get(_PROBE_KEY)
        except StoreAuthError:
            raise
        except StoreError:
            continue
        return endpoint
    return None


def redirected(store: TcpStore) -> Endpoint | None:
    """Where ``store`` sends its clients when it is a standby (a node given one named host's
    address joins the job where its store is now), or None when it serves (or says nothing
    usable: the join that follows reports the store's errors)."""
    try:
        store.get(_PROBE_KEY)
    except StoreRedirect as exc:
        try:
            host, port = parse_endpoint(exc.primary, default_port=0)
            if not port:
                raise ValueError("no port")
            return host, port
        except ValueError:
            log.warning(
                "the standby at %s redirects to %r: not an endpoint", store.endpoint, exc.primary
            )
    except StoreError:
        pass
    return None


def format_endpoint(endpoint: Endpoint) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class StoreFailover:
    """One node's view of where its job's store is: the named ``endpoints``, the ``primary``
    serving now, and this node's own ``server`` (the primary, a standby, or None; a standby
    counts votes by ``elect``, as the job's other standbys do). It moves
    the node's connections (``add_client``; the first also reads the heartbeats for
    ``guard``) when the store moves, and tells ``on_move``."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        token: str | None,
        primary: Endpoint,
        server: TcpStoreServer | None,
        elect: Elect,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.primary = primary
        self._token = token
        self._server = server
        self._elect = elect
        self._clock = clock
        self._clients: list[TcpStore] = []
        self._on_move: list[Callable[[str, int], None]] = []
        self._guard: MajorityWatch | None = None
        self._pause = threading.Event()  # never set: paces the asking

    @property
    def hosting(self) -> bool:
        """Whether this node's own store is the one serving the job."""
        server = self._server
        return server is not None and server.primary is None and self._is_local(self.primary)

    def _is_local(self, endpoint: Endpoint) -> bool:
        server = self._server
        return server is not None and (server.host, server.port) == endpoint

    def add_client(self, store: TcpStore) -> None:
        """Move ``store`` with the job's store."""
        self._clients.append(store)

    def on_move(self, moved: Callable[[str, int], None]) -> None:
        """Call ``moved(host, port)`` when the job's store moves there."""
        self._on_move.append(moved)

    def guard(
        self,
        round_now: RoundNow,
        beat_key: Callable[[int, int], str],
        settings: plan.Settings,
        run_id: str = "",
    ) -> None:
        """Fence this node's store whenever it is the primary and fewer than a majority of the
        running round (with replica groups, of every group's: ``run_id`` is this node's
        group's) beat into it (``MajorityWatch``, reading through the first client)."""
        from relaunch.rendezvous.failover_groups import other_groups_beats

        self._guard = MajorityWatch(
            self._clients[0], round_now, beat_key, settings, self._clock,
            other_groups_beats(run_id),
        )  # fmt: skip
        if self.hosting and self._server is not None:
            self._guard.start(self._server)

    def admit(self, members: int, previous: int | None) -> None:
        """A round of ``members`` just formed on this node's store after one of ``previous``:
        fence the store at once (``StoreFenced``) when that round can never hold the majority
        it needs (``quorum_needed``); only the primary judges."""
        server = self._server
        if not self.hosting or server is None:
            return
        if members < quorum_needed(members, [] if previous is None else [previous]):
            server.fence()
            raise StoreFenced(
                f"a round of {members} formed on this node's store after one of {previous}: "
                "the others may run the job on a standby, so this store lost the job's majority"
            )

    def close(self) -> None:
        """Stop guarding this node's store (shutting down)."""
        if self._guard is not None:
            self._guard.stop()

    def cut_off(self) -> None:
        """The primary was lost: end the calls waiting on it now, and fail the next ones at
        once, until ``resume`` or a move (no thread of this node waits for a silent host)."""
        for client in self._clients:
            client.suspend()

    def resume(self) -> None:
        """Let the clients call the primary again (it answered, or this node waits for it)."""
        for client in self._clients:
            client.resume()

    def check_primary(self, within: float) -> None:
        """Reach the primary within ``within`` seconds; ``StoreError`` (``StoreFenced``: it
        lost the job's majority; ``StoreRefused``: nothing listens there) if it does not serve."""
        _reach(self.primary, within)
        with TcpStore(*self.primary, self._token, timeout=within, connect_timeout=within) as store:
            store.get(_PROBE_KEY)

    def take_over(self, voter: str, within: float) -> Endpoint | None:
        """As ``voter`` (``voter_name``), ask the first named standby that answers (the
        primary's excepted) to take over, which it does once a majority of the last round's
        members asked; move this node there. A store that serves already answers at once.
        Where it went, or None when no standby was promoted within ``within`` seconds."""
        deadline = Deadline(within, self._clock)
        while not deadline.expired():
            for endpoint in self.endpoints:
                if endpoint == self.primary or not _answers(endpoint, min(1.0, deadline.left())):
                    continue
                try:
                    with TcpStore(
                        *endpoint, self._token, timeout=1.0, connect_timeout=1.0
                    ) as store:
                        promoted = store.promote(voter, deadline.left())
                except StoreError as exc:
                    log.debug("could not ask %s to take over: %s", format_endpoint(endpoint), exc)
                    continue
                if not promoted:
                    return None  # the first standby answered, but no majority asked in time
                self._move(endpoint)
                return endpoint
            self._pause.wait(min(0.1, deadline.left()))  # nobody answered yet: ask again
        return None

    def _move(self, endpoint: Endpoint) -> None:
        old, self.primary = self.primary, endpoint
        for client in self._clients:
            client.move_to(*endpoint)
        for moved in self._on_move:
            moved(*endpoint)
        server = self._server
        if server is not None and server.primary is not None and not self._is_local(endpoint):
            server.follow(*endpoint, self._elect)  # this node's standby follows the new one
        if self.hosting and self._guard is not None and server is not None:
            self._guard.start(server)
        log.info("the store moved from %s to %s", format_endpoint(old), format_endpoint(endpoint))


#: How the fence watch sees the running round: (round, members, this node's group rank), or
#: None between rounds.
RoundNow = Callable[[], "tuple[int, int, int] | None"]


class MajorityWatch:
    """The primary's guard against a partition: each keep-alive interval, it reads the running
    round's heartbeat counters (``beat_key(round, group_rank)``) from ``store`` (this node's
    own connection); when fewer than a majority of members (itself included) beat within half
    the detection time (``settings.dead_after``), it fences the store. A gap in its own checks
    (this node was stopped, or starved) starts the count afresh: its silence is not theirs.
    ``others``: the heartbeat keys of the other replica groups' running rounds, whose members
    count with this round's (``failover_groups``)."""

    def __init__(
        self,
        store: TcpStore,
        round_now: RoundNow,
        beat_key: Callable[[int, int], str],
        settings: plan.Settings,
        clock: Clock = SYSTEM_CLOCK,
        others: Callable[[TcpStore], list[list[str]]] | None = None,
    ) -> None:
        self._store, self._round_now, self._beat_key = store, round_now, beat_key
        self._settings, self._clock, self._others = settings, clock, others
        self._stop = threading.Event()
        self._started = False

    def start(self, server: TcpStoreServer) -> None:
        if not self._started:
            self._started = True
            start_thread(self._watch, "relaunch-store-fence", server)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, server: TcpStoreServer) -> None:
        interval = self._settings.keep_alive_interval
        window = self._settings.dead_after / 2
        heard: dict[str, tuple[int, float]] = {}  # a member's beat key: (version, when)
        checked = self._clock.monotonic()
        sizes: dict[int, int] = {}  # the members of each round seen (the last two kept)
        while not self._stop.wait(interval):
            now = self._clock.monotonic()
            stalled, checked = now - checked > 1.5 * interval, now
            running = self._round_now()
            if running is None or server.fenced:
                continue
            round_, members, me = running
            keys = [self._beat_key(round_, rank) for rank in range(members) if rank != me]
            try:
                for group in self._others(self._store) if self._others is not None else ():
                    keys += group
                sizes[round_] = members = len(keys) + 1
                needed = quorum_needed(members, [sizes[r] for r in sizes if r < round_][-1:])
                if not needed:
                    continue  # no majority without every node: nothing can take over from us
                versions = [found.version for found in self._store.get_many(keys)]
            except StoreError as exc:
                log.debug("fence watch: could not read the heartbeats: %s", exc)
                continue
            beating = 1  # this node
            for key, version in zip(keys, versions, strict=True):
                last = heard.get(key)
                if last is None or last[0] != version or stalled:  # a new round: a fresh start
                    last = heard[key] = (version, now)
                if now - last[1] <= window:
                    beating += 1
            if beating < needed:
                server.fence()
                log.warning(
                    "store: only %d of the %d nodes of round %d beat into this store within %s: "
                    "it lost the job's majority and serves nobody from now on",
                    beating,
                    members,
                    round_,
                    seconds(window),
                )
                return
            for stale in set(heard) - set(keys):
                del heard[stale]
            for old in sorted(sizes)[:-2]:
                del sizes[old]
