"""Worker state kept by the agent (``relaunch.save_state``): the slot files' layout, which step
a restarted world resumes from, and the memory bound's arithmetic.

Each global rank has slot files in the agent's shared-memory directory, ``rank{R}.0``,
``rank{R}.1`` and so on; a save writes a slot that does not hold the rank's newest step, and
commits it by rewriting its header last (one ``pwrite``: a worker killed in the middle of a
save leaves the slot uncommitted and the previous save intact). Where the node's state is
copied to other nodes every ``K`` steps (``--state-copy-every K``, K > 1), a rank also keeps its
two newest saves of steps that are multiples of K, the steps every node copies
(``slot_to_write``): so two slots, or four.

Slot layout (little-endian)::

    0: magic 8s | 8: committed u32 | 12: parts u32 | 16: step i64 | 24: generation u64
   32: payload bytes u64 | 40: flags u32 (``REPLICATED``: the same on every rank) | 44..64
   reserved
   64: the parts' lengths, u64 each | then the parts, each at a multiple of ``PART_ALIGN``:
       the pickle (protocol 5), then its out-of-band buffers

A persisted state (``--state-dir``) is a slot's bytes as they were when committed. How an agent
keeps state (its flags) is ``core.workers.state_settings``: this module loads in every worker that
saves, and stays light.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Mapping

STATE_DIR_ENV = "RELAUNCH_STATE_DIR"
STATE_MEMORY_ENV = "RELAUNCH_STATE_MEMORY"
#: The step every rank of this attempt resumes from ("": none, start afresh).
STATE_STEP_ENV = "RELAUNCH_STATE_STEP"

MAGIC = b"RLSTATE2"
HEADER = struct.Struct("<8sIIqQQI")
#: A flag of a slot: its state is every rank's (data parallel), so a rank that lacks its own
#: save of the step may resume from it.
REPLICATED = 1
HEADER_SIZE = 64
#: The offset of the commit flag (a u32): cleared first and set last by a save.
COMMITTED = 8
LENGTH = struct.Struct("<Q")
#: Each part starts at a multiple of this many bytes of the slot (a cache line, as torch's
#: allocator aligns a tensor): a buffer that a load maps in place is aligned as the one saved
#: was, so its tensors compute at full speed and round as the saved ones did (a vectorised sum
#: over other addresses may round otherwise).
PART_ALIGN = 64
#: A header with more parts than this is not one relaunch wrote.
MAX_PARTS = 1 << 24
#: The slots a rank may have (``slot_to_write`` uses the first two, or all four).
SLOTS = (0, 1, 2, 3)
#: Every how many steps the node's state is copied to other nodes (``--state-copy-every``):
#: the saves to keep for them. Unset or 1: every save is copied, the two slots suffice.
COPY_EVERY_ENV = "RELAUNCH_STATE_COPY_EVERY"


def slot_name(rank: int, slot: int) -> str:
    return f"rank{rank}.{slot}"


def persisted_name(rank: int) -> str:
    return f"rank{rank}.state"


def header(
    step: int, generation: int, lengths: Collection[int], committed: bool, flags: int = 0
) -> bytes:
    """The 64-byte header of a slot holding parts of ``lengths``."""
    head = HEADER.pack(
        MAGIC, int(committed), len(lengths), step, generation, payload(lengths), flags
    )
    return head.ljust(HEADER_SIZE, b"\0")


def part_offsets(lengths: Collection[int]) -> list[int]:
    """Where each part of ``lengths`` starts in the slot (after the length table, each at a
    multiple of ``PART_ALIGN``), then where the slot's bytes end."""
    offsets = []
    offset = HEADER_SIZE + LENGTH.size * len(lengths)
    for length in lengths:
        offset += -offset % PART_ALIGN
        offsets.append(offset)
        offset += length
    return [*offsets, offset]


def payload(lengths: Collection[int]) -> int:
    """Bytes after the header: the length table and the parts (with their alignment)."""
    return part_offsets(lengths)[-1] - HEADER_SIZE


class Header:
    """A slot's header as read: ``None`` from ``read_header`` when it is not a committed one."""

    __slots__ = ("flags", "generation", "parts", "payload", "step")

    def __init__(self, step: int, generation: int, parts: int, payload: int, flags: int) -> None:
        self.step, self.generation, self.parts, self.payload = step, generation, parts, payload
        self.flags = flags

    @property
    def replicated(self) -> bool:
        return bool(self.flags & REPLICATED)

    @property
    def size(self) -> int:
        """The slot's bytes in use: header and payload."""
        return HEADER_SIZE + self.payload


def read_header(data: bytes) -> Header | None:
    """The header of a committed slot from its first ``HEADER_SIZE`` bytes; None otherwise."""
    if len(data) < HEADER.size:
        return None
    magic, committed, parts, step, generation, length, flags = HEADER.unpack_from(data)
    if magic != MAGIC or committed != 1 or not 0 < parts <= MAX_PARTS:
        return None
    if length < LENGTH.size * parts:
        return None
    return Header(step, generation, parts, length, flags)


def steps_held(own: Mapping[int, Collection[Header]]) -> dict[int, list[int]]:
    """The steps each rank of one node can resume from: its own saves, and the replicated
    saves of any rank of the node (``REPLICATED``)."""
    shared = {head.step for heads in own.values() for head in heads if head.replicated}
    return {rank: sorted({head.step for head in heads} | shared) for rank, heads in own.items()}


def is_copy_step(step: int, copy_every: int) -> bool:
    """Whether the saves of ``step`` are the ones copied to other nodes (every node copies the
    same steps, so a node's loss finds its ranks' copies at a step the survivors kept)."""
    return copy_every <= 1 or step % copy_every == 0


def slot_to_write(committed: Mapping[int, Header], copy_every: int) -> int:
    """The slot a rank's next save goes to, given its committed slots (by slot number): never
    the newest (a death in the middle of the save leaves it), nor, with ``copy_every`` > 1, one
    of the two newest saves of copy steps (``is_copy_step``: another node may be copying it,
    or hold the copy a node's loss resumes from). An empty slot first, else the oldest."""
    usable = SLOTS[:2] if copy_every <= 1 else SLOTS
    by_age = sorted(committed.items(), key=lambda item: item[1].generation, reverse=True)
    kept = {slot for slot, _ in by_age[:1]}
    if copy_every > 1:
        copies = [slot for slot, head in by_age if is_copy_step(head.step, copy_every)]
        kept.update(copies[:2])
    free = [slot for slot in usable if slot not in committed]
    if free:
        return free[0]
    return min(
        (slot for slot in usable if slot not in kept),
        key=lambda slot: committed[slot].generation,
    )


def successors(group_rank: int, group_world_size: int, replicas: int) -> list[int]:
    """The group ranks a node copies its state to: the next ``replicas`` in ring order over
    the round's members, itself never (so that losing up to ``replicas`` nodes at once, the
    node among them, leaves a copy of its state)."""
    count = min(replicas, group_world_size - 1)
    return [(group_rank + k) % group_world_size for k in range(1, count + 1)]


def common_step(steps: Mapping[int, Collection[int]], world_size: int) -> int | None:
    """The newest step every rank ``0 .. world_size-1`` has (None: a rank has none, or no step
    is common): the step a re-formed world resumes from."""
    if world_size < 1 or any(rank not in steps for rank in range(world_size)):
        return None
    shared = set(steps[0])
    for rank in range(1, world_size):
        shared &= set(steps[rank])
    return max(shared) if shared else None


def no_common_step(held: Mapping[int, Collection[int]], world_size: int) -> str:
    """The line that says why a world of ``world_size`` ranks starts afresh though state was
    kept (``held``: the steps each rank has, on any node)."""
    empty = [rank for rank in range(world_size) if not held.get(rank)]
    if empty:
        more = f" (nor {len(empty) - 1} more)" if len(empty) > 1 else ""
        return f"rank {empty[0]} has no kept state{more}: the workers start afresh"
    behind = min(range(world_size), key=lambda rank: max(held[rank]))
    ahead = max(range(world_size), key=lambda rank: min(held[rank]))
    return (
        f"no step of the kept state is held for every rank (rank {behind} holds "
        f"{_span(held[behind])}, rank {ahead} holds {_span(held[ahead])}): the workers start "
        "afresh. Where each rank saves its own state, --state-copy-every K has every node "
        "copy and keep the same steps (docs/recovery.md)"
    )


def _span(steps: Collection[int]) -> str:
    return f"steps {min(steps)}-{max(steps)}" if len(steps) > 1 else f"step {min(steps)}"


def format_bytes(size: int) -> str:
    """``size`` as people read it: ``100 MiB``, ``1.5 GiB``, ``512 B``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.3g} {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    return f"{value:.3g} TiB"


def too_large(needed: int, in_use: int, limit: int) -> str | None:
    """The one line a save that does not fit the bound gets, or None when it fits.
    ``in_use``: the other slots' bytes, which stay."""
    if in_use + needed <= limit:
        return None
    return (
        f"save_state needs {format_bytes(needed)} but the agent's state memory holds "
        f"{format_bytes(limit)} ({format_bytes(in_use)} in use by the other saves): raise "
        "--state-memory (PET_STATE_MEMORY) or save less"
    )
