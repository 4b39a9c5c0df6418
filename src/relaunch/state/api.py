"""What a worker calls to keep its state in its agent's memory: ``save_state`` and
``load_state``.

The agent owns a shared-memory directory (``RELAUNCH_STATE_DIR``) that outlives its workers;
each rank saves into two slot files of its own (``core.workers.state``), so a worker killed in the
middle of a save leaves its previous save whole. Before each attempt the agents agree on the
newest step every rank of the new world has (``RELAUNCH_STATE_STEP``), and ``load_state``
gives it. Outside relaunch both do nothing (``load_state`` returns None).
"""

from __future__ import annotations

import os

from relaunch.core.workers import state as layout

TYPE_CHECKING = False  # not typing's: importing typing costs a worker milliseconds
if TYPE_CHECKING:
    from typing import Any

    from relaunch.core.workers.state import Header
    from relaunch.state.files import SlotWriter

_slots: dict[int, SlotWriter] = {}  # slot -> the mapped slot file of this process' rank
_committed: dict[int, Header] = {}  # slot -> its committed save, as this process knows it
_opened_for: tuple[str, int] | None = None  # the directory and rank the slots belong to


def _forget() -> None:
    """In a forked child: its own slots, looked at afresh."""
    global _opened_for
    _slots.clear()  # the parent's maps: left to it
    _committed.clear()
    _opened_for = None


os.register_at_fork(after_in_child=_forget)


def _reopen() -> None:
    """This process runs a new attempt (restarted in place): its slots are looked at afresh at
    the next save, and the ones it mapped are let go then."""
    global _opened_for
    _opened_for = None


class StateError(RuntimeError):
    """A save that cannot be kept (too large for ``--state-memory``, the memory full) or a
    load that cannot be read; the message says what to do."""


def _where() -> tuple[str, int, int] | None:
    """The agent's state directory, this worker's global and local rank; None outside
    relaunch."""
    directory = os.environ.get(layout.STATE_DIR_ENV)
    rank, local = os.environ.get("RANK", ""), os.environ.get("LOCAL_RANK", "")
    if not directory or not rank.isdigit() or not local.isdigit():
        return None
    return directory, int(rank), int(local)


def _open_slots(directory: str, rank: int) -> None:
    """Look at this rank's slots afresh (once per process): which hold which save."""
    global _opened_for
    from relaunch.state.files import committed

    for writer in _slots.values():
        writer.close()
        os.close(writer.fd)
    _slots.clear()
    _committed.clear()
    _committed.update(committed(directory, rank))
    _opened_for = (directory, rank)


def _writer(directory: str, rank: int, slot: int) -> SlotWriter:
    """The slot file ``slot`` of ``rank``, opened (and later mapped) once per process."""
    if slot not in _slots:
        from relaunch.state.files import SlotWriter

        path = os.path.join(directory, layout.slot_name(rank, slot))
        _slots[slot] = SlotWriter(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    return _slots[slot]


def _others_in_use(directory: str, mine: str) -> int:
    """Bytes of shared memory the directory's other files hold (the other nodes' copies in
    its ``peers`` too)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name != mine and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
            elif entry.is_dir(follow_symlinks=False):
                total += _others_in_use(entry.path, "")
    return total


def save_state(state: Any, step: int, *, replicated: bool = False) -> None:
    """Keep ``state`` (any picklable object: a dict of tensors and optimizer state too) as this
    rank's state at ``step``, in memory the agent owns: it survives this worker's death, and
    after a restart ``load_state`` gives it back. Copies each byte once (pickle protocol 5,
    buffers out of band); the previous save stays whole until this one is committed.
    ``replicated``: the state is the same on every rank (data parallel), so a rank of this node
    that lacks its own save of ``step`` (it failed first) may resume from this one: what a
    just-in-time save (``failure_pending``) should say. ``StateError`` when it does not fit
    ``--state-memory``. Outside relaunch it does nothing."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_state's step must be a whole number >= 0, got {step!r}")
    where = _where()
    if where is None:
        return
    directory, rank, _ = where
    if _opened_for != (directory, rank):
        _open_slots(directory, rank)
    from relaunch.pickling import dump_parts

    parts = dump_parts(state)
    lengths = [part.nbytes for part in parts]
    needed = layout.HEADER_SIZE + layout.payload(lengths)
    copy_every = os.environ.get(layout.COPY_EVERY_ENV, "")
    slot = layout.slot_to_write(_committed, int(copy_every) if copy_every.isdigit() else 1)
    name = layout.slot_name(rank, slot)
    limit = int(os.environ.get(layout.STATE_MEMORY_ENV) or 0)
    if limit:
        problem = layout.too_large(needed, _others_in_use(directory, name), limit)
        if problem is not None:
            raise StateError(problem)
    generation = 1 + max((head.generation for head in _committed.values()), default=0)
    flags = layout.REPLICATED if replicated else 0
    _committed.pop(slot, None)  # uncommitted from here until the write's end
    try:
        _writer(directory, rank, slot).write(step, generation, parts, flags)
    except OSError as exc:
        raise StateError(
            f"save_state could not keep {layout.format_bytes(needed)} in {directory}: "
            f"{exc.strerror or exc}; lower --state-memory below what the machine's /dev/shm "
            "holds, or save less"
        ) from None
    _committed[slot] = layout.Header(step, generation, len(parts), layout.payload(lengths), flags)
    from relaunch.worker import note_saved  # the agent counts it (``relaunch.worker``)

    note_saved()


def load_state() -> tuple[int, Any] | None:
    """``(step, state)``: what this rank saved at the newest step every rank of this world has
    (the same step on every rank), or None when there is none (a first start, outside
    relaunch). ``StateError`` when the kept state cannot be read back."""
    import time

    from relaunch.worker import note_restore

    began = time.time()
    loaded = _load()
    note_restore(began, time.time(), -1 if loaded is None else loaded[0])
    return loaded


def _load() -> tuple[int, Any] | None:
    where = _where()
    step_text = os.environ.get(layout.STATE_STEP_ENV, "")
    if where is None or not step_text.isdigit():
        return None
    directory, rank, _ = where
    step = int(step_text)
    from relaunch.state.files import StateCorrupt, file_header, find_slot, read_slot

    path = find_slot(directory, rank, step)
    head = None if path is None else file_header(path)
    if path is not None and head is not None and head.step == step:
        own = os.path.dirname(path) == directory and os.path.basename(path).startswith(
            f"rank{rank}."
        )
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            parts = read_slot(fd, head, own)
        except StateCorrupt as exc:
            raise StateError(f"load_state: rank {rank}'s state of step {step}: {exc}") from None
        finally:
            os.close(fd)
        import pickle

        return step, pickle.loads(parts[0], buffers=parts[1:])
    raise StateError(
        f"load_state: rank {rank}'s state of step {step} is no longer in {directory} (another "
        "process of this rank saved over it before load_state): call load_state before "
        "save_state"
    )
