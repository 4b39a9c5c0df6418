"""The agent's side of the state its workers keep (``relaunch.save_state``): the shared-memory
directory that outlives them, the step each attempt resumes from (the nodes' records exchanged
here, merged by ``core.workers.state_agreement``), the copies on disk (``--state-dir``), and the
wait for just-in-time saves when a failure is pending (counted in ``agent.state_saves``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from relaunch.agent.channel import Channel
from relaunch.agent.shm import STATE_PREFIX, PrivateDirectory
from relaunch.agent.state_saves import SaveCounts
from relaunch.core.durations import seconds
from relaunch.core.workers import state as layout
from relaunch.core.workers.state import Header
from relaunch.core.workers.state_settings import StateSettings, default_memory
from relaunch.procs.worker_process import FailureGrace
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import start_thread
from relaunch.state.files import (
    committed,
    copy_committed,
    file_header,
    find_slot,
    forget_after,
    held_steps,
    prune_peers,
    replicated_steps,
)

if TYPE_CHECKING:
    from relaunch.agent.state_peers import PeerLink

log = logging.getLogger(__name__)

#: How long the nodes wait for each other's steps before an attempt (a lost node ends it).
AGREE_TIMEOUT = 60.0
#: Failed agreements in a row after which the workers start without state after all (a job
#: that cannot agree at all still runs, from the start; it says so).
AGREE_TRIES = 3


class StateNotAgreed(Exception):
    """The nodes could not agree on a step to resume from: the workers must not start (their
    fresh saves would overwrite the state kept); the node joins again."""


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class StateKeeper:
    """The state of one agent's workers, run after run, kept as ``settings`` say. With
    ``peer_host`` (the address the node is known by in a job of several nodes), the nodes
    agree on the step to resume from; with ``peer_key`` too (``JobServices.peer_key``: the job
    has a token), the state is also copied to other nodes (``agent.state_peers``). Without a
    key, whoever reaches a node could plant state its workers would unpickle: none is copied,
    and a node of several says so once, at its workers' first save. The workers' saves are
    counted as ``channel`` tells them (``Channel.saves_to``)."""

    def __init__(
        self,
        settings: StateSettings,
        peer_host: str | None = None,
        peer_key: str | None = None,
        channel: Channel | None = None,
    ) -> None:
        memory = settings.memory
        self.memory = default_memory(machine_memory()) if memory is None else memory
        self.state_dir = state_dir = settings.directory
        self.persist_every = settings.persist_every
        self.jit_save_timeout = settings.jit_save_timeout
        self.replicas = settings.replicas
        self.copy_every = settings.copy_every
        self._copying = False  # this attempt's saves are copied to other nodes
        # Removed even if this process is SIGKILLed, or its whole job at once (``agent.shm``).
        self._private = PrivateDirectory(STATE_PREFIX)
        self.directory = self._private.path
        self.counts = SaveCounts()
        self._persisted_at = 0  # the total of saves at the last copy to disk
        self._ranks: dict[int, int] = {}  # local rank -> global rank, this attempt
        self._closing = False
        self._persist_wanted = threading.Event()
        self._peers: PeerLink | None = None
        self._agreed: int | None = None  # the step the last attempt's nodes agreed on
        self._not_agreed = 0  # failed agreements in a row
        self._several = peer_host is not None  # a node of a job of several: agree with them
        self._uncopied = False  # a node of several with no copies: said at the first save
        self._uncopied_said = False
        if peer_host is not None and peer_key is not None:
            from relaunch.agent.state_peers import PeerLink  # sockets: a job of several nodes

            self._peers = PeerLink(
                self.directory, peer_host, self.memory, peer_key, self.copy_every
            )
        self._channel = channel
        if channel is not None:
            channel.saves_to(self._saved)
        self._persister = (
            None if state_dir is None else start_thread(self._persist_loop, "relaunch-state-disk")
        )

    def env(self, step: int | None) -> dict[str, str]:
        """What every worker of an attempt that resumes from ``step`` is given (the copy steps'
        cadence only where it is not every step)."""
        env = {
            layout.STATE_DIR_ENV: self.directory,
            layout.STATE_MEMORY_ENV: str(self.memory),
            layout.STATE_STEP_ENV: "" if step is None else str(step),
        }
        if self._kept_every > 1:
            env[layout.COPY_EVERY_ENV] = str(self._kept_every)
        return env

    @property
    def _kept_every(self) -> int:
        """Every how many steps this attempt's saves are copied to other nodes (and kept)."""
        return self.copy_every if self._copying else 1

    # -- before an attempt ---------------------------------------------------------------

    def agree(
        self,
        job: JobServices,
        group_rank: int,
        group_world_size: int,
        ranks: Mapping[int, int],
        world_size: int,
    ) -> int | None:
        """The newest step every rank of the new world (``world_size`` ranks) has, on any
        node, agreed with every node (None: start afresh; ``StateNotAgreed`` when the nodes
        could not agree, ``AGREE_TRIES`` - 1 times in a row); what this node's new ranks need of
        it and lack is copied here first. ``ranks``: this node's local ranks -> their global
        ranks."""
        self._ranks = dict(ranks)
        # What a requeued job has on disk counts at once; it is copied here after the nodes
        # agreed, so that no node waits on another's disk.
        coming = self._on_disk(ranks.values())
        held = held_steps(self.directory, coming)
        if group_world_size == 1 or not self._several:
            self._seed(coming)
            self._copying = False
            step = layout.common_step(held, world_size)
            return self._resume(step, held, world_size, ranks.values(), {})
        # Only nodes that keep state together agree on it: a single node never loads this.
        from relaunch.core.workers.state_agreement import NodeState, agreement, node_held

        replicated = set(replicated_steps(held, self.directory))
        replicated.update(head.step for head in coming.values() if head.replicated)
        self._uncopied = self._peers is None and self.replicas > 0
        address = None if self._peers is None else self._peers.address
        mine = NodeState(address, held, sorted(replicated), sorted(ranks.values()))
        parts = job.gather("state", group_rank, group_world_size, mine.encode(), AGREE_TIMEOUT)
        self._seed(coming)
        if parts is None:
            self._not_agreed_again()
            return None
        self._not_agreed = 0
        nodes = {}
        for member, raw in parts.items():
            try:
                nodes[member] = node_held(raw)
            except ValueError as exc:  # from the store: checked, never trusted
                log.warning(
                    "group rank %d posted a state record relaunch cannot read: %s", member, exc
                )
        agreed = agreement(nodes, world_size, group_rank, group_world_size, self.replicas)
        if self._peers is not None:
            self._peers.follow(agreed.successors)
        self._copying = self._peers is not None and bool(agreed.successors)
        return self._resume(agreed.step, agreed.held, world_size, ranks.values(), agreed.holders)

    def _not_agreed_again(self) -> None:
        """The nodes did not agree: ``StateNotAgreed``, or, ``AGREE_TRIES`` times in a row,
        the workers start afresh (None)."""
        self._not_agreed += 1
        why = f"the nodes could not agree on a step to resume from within {seconds(AGREE_TIMEOUT)}"
        if self._not_agreed < AGREE_TRIES:
            raise StateNotAgreed(why)
        log.warning(
            "%s, %d times in a row: the workers start without state (load_state() returns "
            "None), and their saves replace what was kept",
            why,
            self._not_agreed,
        )
        self._not_agreed = 0
        forget_after(self.directory, None)

    def _resume(
        self,
        step: int | None,
        held: Mapping[int, list[int]],
        world_size: int,
        ranks: Collection[int],
        holders: Mapping[tuple[int, int], str],
    ) -> int | None:
        """The world resumes from ``step`` (None: afresh, said when state was kept but no step
        is every rank's): what came after it is forgotten, and it is brought here for
        ``ranks``."""
        if step is None and any(held.values()):
            log.warning("%s", layout.no_common_step(held, world_size))
        forget_after(self.directory, step)
        self._fetch(step, ranks, holders)
        self._agreed = step
        return step

    def _say_uncopied(self) -> None:
        """Once, at the first save: a node of several without the job's key keeps its state
        to itself."""
        if self._uncopied and not self._uncopied_said:
            self._uncopied_said = True
            log.warning(
                "kept state stays on this node (a lost node's is lost with it): copies to "
                "other nodes are off without the job's token, which proves them (a worker "
                "unpickles what it loads); set the same --rdzv-conf token=... (or "
                "$RELAUNCH_RDZV_TOKEN) on every node to turn them on"
            )

    def hold_copies(self) -> None:
        """The workers stop: copy no state to the successors until they save again
        (``PeerLink.hold``)."""
        if self._peers is not None:
            self._peers.hold()

    def prune(self) -> None:
        """Forget the other nodes' copies older than the step last agreed (once the workers
        started: freeing their memory takes time the restart need not wait for)."""
        if self._agreed is not None:
            prune_peers(self.directory, self._agreed)

    def _fetch(
        self,
        step: int | None,
        ranks: Collection[int],
        holders: Mapping[tuple[int, int], str],
    ) -> None:
        """Make ``step`` of each of ``ranks`` one of its own slots here (``load_state`` reads
        those): from a peer copy or a replicated save on this node, else pulled from a node
        that holds it."""
        if step is None:
            return
        for rank in ranks:
            own = committed(self.directory, rank)
            if any(head.step == step for head in own.values()):
                continue
            target = self._slot(rank, layout.slot_to_write(own, self._kept_every))
            source = find_slot(self.directory, rank, step)
            try:
                if source is not None:
                    copy_committed(source, target, fsync=False)
                elif self._peers is not None and (rank, step) in holders:
                    self._peers.pull(holders[(rank, step)], rank, step, target)
            except (OSError, ValueError) as exc:
                log.warning("could not fetch rank %d's state of step %d: %s", rank, step, exc)
            head = file_header(target)
            if head is None or head.step != step:
                log.warning(
                    "rank %d's state of step %d could not be brought here: its load_state() "
                    "will fail",
                    rank,
                    step,
                )

    def _on_disk(self, ranks: Collection[int]) -> dict[int, Header]:
        """The saves on disk (``--state-dir``: a requeued job) of the ranks of ``ranks`` with
        nothing in memory here, by rank."""
        if self.state_dir is None:
            return {}
        found = {}
        for rank in ranks:
            if not committed(self.directory, rank):
                head = file_header(os.path.join(self.state_dir, layout.persisted_name(rank)))
                if head is not None:
                    found[rank] = head
        return found

    def _seed(self, saves: Mapping[int, Header]) -> None:
        """Copy the saves on disk ``saves`` (``_on_disk``) into memory."""
        if self.state_dir is None:
            return
        for rank in saves:
            source = os.path.join(self.state_dir, layout.persisted_name(rank))
            try:
                copy_committed(source, self._slot(rank, 0), fsync=False)
            except OSError as exc:
                log.warning("could not restore rank %d's state from %s: %s", rank, source, exc)

    def _slot(self, rank: int, slot: int) -> str:
        return os.path.join(self.directory, layout.slot_name(rank, slot))

    # -- while it runs ---------------------------------------------------------------------

    def _saved(self, new: dict[int, int]) -> None:
        """The channel's thread: the workers committed ``new`` saves, by local rank."""
        total = self.counts.add(new)
        ranks = self._ranks
        if self._peers is not None:
            for local in new:
                if local in ranks:
                    self._peers.saved(ranks[local])
        self._say_uncopied()
        if total - self._persisted_at >= self.persist_every * max(1, len(ranks)):
            self._persisted_at = total
            self._persist_wanted.set()

    def saves(self) -> dict[int, int]:
        """Saves committed so far, by local rank."""
        return self.counts.saves()

    def newest_saved_step(self) -> int | None:
        """The newest step this attempt's ranks have committed here (None: none kept)."""
        steps = [
            head.step
            for rank in self._ranks.values()
            for head in committed(self.directory, rank).values()
        ]
        return max(steps, default=None)

    def wait_for_saves(
        self,
        ranks: Collection[int],
        running: Callable[[], Collection[int]],
        timeout: float,
        tell: Callable[[], None],
    ) -> set[int]:
        """``SaveCounts.wait_for_saves``: the local ranks of ``ranks`` that neither saved nor
        ended within ``timeout`` seconds of ``tell()``."""
        return self.counts.wait_for_saves(ranks, running, timeout, tell)

    def _persist_loop(self) -> None:
        while True:
            self._persist_wanted.wait()
            self._persist_wanted.clear()
            if self._closing:
                return
            self.persist()

    def persist(self) -> None:
        """Copy each local rank's newest committed state to ``state_dir`` (a full disk: one
        line, and the copy there before stays)."""
        if self.state_dir is None:
            return
        for rank in list(self._ranks.values()):
            slots = committed(self.directory, rank)
            if not slots:
                continue
            slot = max(slots, key=lambda number: slots[number].generation)
            source = self._slot(rank, slot)
            target = os.path.join(self.state_dir, layout.persisted_name(rank))
            try:
                os.makedirs(self.state_dir, exist_ok=True)
                copy_committed(source, target, fsync=True)
            except OSError as exc:
                log.warning("could not write rank %d's state to %s: %s", rank, target, exc)

    def close(self) -> None:
        """The job ended, whichever way: the newest state to disk, the memory freed."""
        self._closing = True
        self._persist_wanted.set()
        if self._channel is not None:
            self._channel.saves_to(None)
        if self._persister is not None:
            self._persister.join()
        self.persist()
        if self._peers is not None:
            self._peers.close()
        self._private.close()


class JustInTime(FailureGrace):
    """A failure of one of this node's workers: the others that listen
    (``relaunch.failure_pending``) are told, and their stop waits up to ``timeout`` seconds
    for their saves (``procs.monitor.FailureGrace``)."""

    def __init__(self, keeper: StateKeeper, channel: Channel, timeout: float) -> None:
        self._keeper, self._channel, self._timeout = keeper, channel, timeout

    def begin(self, running: set[int], release: Callable[[], None]) -> float:
        listening = self._channel.failure_listeners(running)
        if not listening or self._timeout <= 0:
            return 0.0
        self._keeper.counts.expect_saves(listening, release)
        self._channel.announce_failure()
        return self._timeout

    def exited(self, local_rank: int) -> None:
        self._keeper.counts.not_expected(local_rank)
