"""The agent's side of the state its workers keep (``relaunch.save_state``): the shared-memory
directory that outlives them, the step each attempt resumes from (agreed by every node), the
copies on disk (``--state-dir``), and the wait for just-in-time saves when a failure is pending.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, NamedTuple

from relaunch.agent.channel import Channel
from relaunch.agent.shm import STATE_PREFIX, PrivateDirectory
from relaunch.core import state as layout
from relaunch.core.durations import seconds
from relaunch.core.state import Header
from relaunch.core.state_settings import StateSettings, default_memory
from relaunch.procs.monitor import FailureGrace
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import start_thread
from relaunch.state.files import (
    PEERS,
    committed,
    copy_committed,
    file_header,
    find_slot,
    held_steps,
    replicated_steps,
    slot_files,
    uncommit,
)

if TYPE_CHECKING:
    from relaunch.agent.state_peers import PeerLink

log = logging.getLogger(__name__)

#: How often a wait for just-in-time saves looks whether the workers it waits for still run.
EXIT_CHECK = 0.05
#: How long the nodes wait for each other's steps before an attempt (a lost node ends it).
AGREE_TIMEOUT = 60.0
#: Failed agreements in a row after which the workers start without state after all (a job
#: that cannot agree at all still runs, from the start; it says so).
AGREE_TRIES = 3


class StateNotAgreed(Exception):
    """The nodes could not agree on a step to resume from: the workers must not start (their
    fresh saves would overwrite the state kept); the node joins again."""


class NodeState(NamedTuple):
    """A node's state record (``agree``): its state server's address (None: it copies no
    state), the steps it holds by rank, those of its replicated saves, and the global ranks it
    runs in the new world."""

    address: str | None
    held: dict[int, list[int]]
    replicated: list[int]
    runs: list[int]

    def reaches(self, rank: int, runner: NodeState | None) -> bool:
        """Whether ``rank``, run by ``runner`` (None: not known), can resume from what this
        node holds: a rank of its own, or one whose node can pull it from this one (both
        copy state: the job has a token)."""
        if rank in self.runs:
            return True
        return self.address is not None and (runner is None or runner.address is not None)


def _whole_numbers(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )


def node_held(raw: bytes) -> NodeState:
    """A node's state record, read; ``ValueError`` saying what is wrong when it is not one."""
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise ValueError("not an object")
    address, held = record.get("address"), record.get("held")
    if not (address is None or isinstance(address, str)) or not isinstance(held, dict):
        raise ValueError("address and held are not a string (or null) and an object")
    steps: dict[int, list[int]] = {}
    for rank, kept in held.items():
        if not rank.isdigit() or not isinstance(kept, list):
            raise ValueError(f"held[{rank!r}] is not a rank's list of steps")
        if not _whole_numbers(kept):
            raise ValueError(f"held[{rank!r}] holds a step that is not a whole number")
        steps[int(rank)] = kept
    replicated, runs = record.get("replicated", []), record.get("runs", [])
    if not _whole_numbers(replicated) or not _whole_numbers(runs):
        raise ValueError("replicated and runs are not lists of whole numbers")
    return NodeState(address, steps, replicated, runs)


def prune_peers(directory: str, step: int) -> None:
    """Forget the other nodes' copies older than ``step``: no world resumes from them again
    (those newer are forgotten as the nodes agree: ``forget_after``)."""
    peers = os.path.join(directory, PEERS)
    try:
        names = os.listdir(peers)
    except FileNotFoundError:
        return
    for name in names:
        head = file_header(os.path.join(peers, name))
        if head is not None and head.step < step:
            try:
                os.unlink(os.path.join(peers, name))
            except FileNotFoundError:
                pass


def forget_after(directory: str, step: int | None) -> None:
    """Uncommit every save and copy in ``directory`` of a step after ``step`` (None: of any
    step): every node resumes from ``step``, and what came after it is another history, which
    a later agreement must never take for this one's."""
    for _, path, head in list(slot_files(directory)):
        if step is None or head.step > step:
            uncommit(path)


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class StateKeeper:
    """The state of one agent's workers, run after run, kept as ``settings`` say. With
    ``peer_host`` (the address the node is known by in a job of several nodes), the nodes
    agree on the step to resume from; with ``peer_key`` too (``JobServices.peer_key``: the job
    has a token), the state is also copied to other nodes (``agent.state_peers``). Without a
    key, whoever reaches a node could plant state its workers would unpickle: none is copied,
    and a node of several says so once, at its workers' first save."""

    def __init__(
        self, settings: StateSettings, peer_host: str | None = None, peer_key: str | None = None
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
        fifo = os.path.join(self.directory, layout.SAVED_FIFO)
        os.mkfifo(fifo, 0o600)
        self._saved_fd = os.open(fifo, os.O_RDWR)  # never waits for a writer; reads block
        self._changed = threading.Condition()
        self._saves: dict[int, int] = {}  # local rank -> saves committed, in this run
        self._persisted_at = 0  # the total of saves at the last copy to disk
        self._ranks: dict[int, int] = {}  # local rank -> global rank, this attempt
        self._closing = False
        self._expected: dict[int, int] = {}  # local rank -> saves it had when told to save
        self._on_expected: Callable[[], None] | None = None
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
        self._reader = start_thread(self._read_saves, "relaunch-state-saves")
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
        with self._changed:
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
        replicated_here = set(replicated_steps(held, self.directory))
        replicated_here.update(head.step for head in coming.values() if head.replicated)
        self._uncopied = self._peers is None and self.replicas > 0
        mine = {
            "address": None if self._peers is None else self._peers.address,
            "held": held,
            "replicated": sorted(replicated_here),
            "runs": sorted(ranks.values()),
        }
        parts = job.gather(
            "state", group_rank, group_world_size, json.dumps(mine).encode(), AGREE_TIMEOUT
        )
        self._seed(coming)
        if parts is None:
            self._not_agreed += 1
            within = seconds(AGREE_TIMEOUT)
            why = f"the nodes could not agree on a step to resume from within {within}"
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
        anywhere: dict[int, set[int]] = {}
        holders: dict[tuple[int, int], str] = {}
        runners = {rank: node for node in nodes.values() for rank in node.runs}
        for node in nodes.values():
            # Any rank may resume from a replicated save; without copies (no token), a node
            # holds steps for its own ranks alone. Every node reads the same records: the
            # same step.
            for rank in range(world_size):
                steps = node.held.get(rank, []) + node.replicated
                if steps and node.reaches(rank, runners.get(rank)):
                    anywhere.setdefault(rank, set()).update(steps)
                    for kept in steps:
                        if node.address is not None:
                            holders.setdefault((rank, kept), node.address)
        successors = [
            address
            for member in layout.successors(group_rank, group_world_size, self.replicas)
            if member in nodes and (address := nodes[member].address) is not None
        ]
        if self._peers is not None:
            self._peers.follow(successors)
        self._copying = self._peers is not None and bool(successors)
        step = layout.common_step(anywhere, world_size)
        held_anywhere = {rank: sorted(steps) for rank, steps in anywhere.items()}
        return self._resume(step, held_anywhere, world_size, ranks.values(), holders)

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

    def _read_saves(self) -> None:
        record = layout.SAVED.size
        while True:
            data = os.read(self._saved_fd, record * 512)
            if self._closing:
                return
            with self._changed:
                for at in range(0, len(data) - record + 1, record):
                    (local,) = layout.SAVED.unpack_from(data, at)
                    self._saves[local] = self._saves.get(local, 0) + 1
                    if self._peers is not None and local in self._ranks:
                        self._peers.saved(self._ranks[local])
                self._settle_expected()
                if data:
                    self._say_uncopied()
                total = sum(self._saves.values())
                ranks = max(1, len(self._ranks))
                if total - self._persisted_at >= self.persist_every * ranks:
                    self._persisted_at = total
                    self._persist_wanted.set()
                self._changed.notify_all()

    def saves(self) -> dict[int, int]:
        """Saves committed so far, by local rank."""
        with self._changed:
            return dict(self._saves)

    def newest_saved_step(self) -> int | None:
        """The newest step this attempt's ranks have committed here (None: none kept)."""
        steps = [
            head.step
            for rank in self._ranks.values()
            for head in committed(self.directory, rank).values()
        ]
        return max(steps, default=None)

    def expect_saves(self, ranks: Collection[int], then: Callable[[], None]) -> None:
        """Call ``then()`` (from the saves' thread) once each local rank of ``ranks`` has
        saved from now on, or is counted out (``not_expected``)."""
        with self._changed:
            self._expected = {rank: self._saves.get(rank, 0) for rank in ranks}
            self._on_expected = then
            self._settle_expected()

    def not_expected(self, rank: int) -> None:
        """Local rank ``rank`` will not save (it ended)."""
        with self._changed:
            self._expected.pop(rank, None)
            self._settle_expected()

    def _settle_expected(self) -> None:
        """Drop the ranks that saved; ``then()`` once none is left (the lock held)."""
        for rank, before in list(self._expected.items()):
            if self._saves.get(rank, 0) > before:
                del self._expected[rank]
        if not self._expected and self._on_expected is not None:
            then, self._on_expected = self._on_expected, None
            then()

    def wait_for_saves(
        self,
        ranks: Collection[int],
        running: Callable[[], Collection[int]],
        timeout: float,
        tell: Callable[[], None],
    ) -> set[int]:
        """``tell()`` the local ranks ``ranks`` to save (once their saves are expected: none
        is missed), then wait up to ``timeout`` seconds until each has saved or ended
        (``running()``, asked every ``EXIT_CHECK`` seconds: a worker's end has no event here);
        the ranks that did neither."""
        saved = threading.Event()
        self.expect_saves(ranks, saved.set)
        tell()
        deadline = time.monotonic() + timeout
        while not saved.wait(min(EXIT_CHECK, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            alive = set(running())
            for rank in set(ranks) - alive:
                self.not_expected(rank)
        with self._changed:
            missing, self._expected, self._on_expected = set(self._expected), {}, None
        return missing

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
        with self._changed:
            ranks = list(self._ranks.values())
        for rank in ranks:
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
        os.write(self._saved_fd, layout.SAVED.pack(0))  # ends the reader
        self._reader.join()
        if self._persister is not None:
            self._persister.join()
        self.persist()
        if self._peers is not None:
            self._peers.close()
        os.close(self._saved_fd)
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
        self._keeper.expect_saves(listening, release)
        self._channel.announce_failure()
        return self._timeout

    def exited(self, local_rank: int) -> None:
        self._keeper.not_expected(local_rank)
