"""The slot files of ``core.workers.state``: each byte is copied once from the worker's memory into
the shared-memory file, and at most once back, after a load (``_copied_pages``)."""

from __future__ import annotations

import errno
import mmap
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence

from relaunch.core.workers.state import (
    COMMITTED,
    HEADER_SIZE,
    LENGTH,
    SLOTS,
    Header,
    header,
    part_offsets,
    read_header,
    slot_name,
    steps_held,
)

#: The subdirectory of a state directory that holds other nodes' copies (``agent.state_peers``).
PEERS = "peers"


#: Parts this large are read into memory mapped for them alone (``_part_memory``).
MAPPED_PART = 1 << 20


class StateCorrupt(Exception):
    """A committed slot whose bytes do not match its header (changed while read, or damaged)."""


def write_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _part_memory(length: int) -> bytearray | memoryview:
    """Writable memory for a part of ``length`` bytes that a load reads into (where
    ``_copied_pages`` does not give it). A large part gets an anonymous mapping of its own
    whose pages the kernel provides at once (``MAP_POPULATE``): a ``bytearray`` would fault
    them in one by one and zero them first, which costs a 4-rank load on two cores as much as
    the copy itself. One mapping a part, so that a tensor the
    worker drops (a model's, once copied into its parameters) frees its memory while one it
    keeps (an optimizer's) holds only its own."""
    if length < MAPPED_PART:
        return bytearray(length)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, length, flags=flags))


#: ``madvise``'s ``MADV_POPULATE_WRITE`` (Linux 5.14): every page of a mapping written now.
_POPULATE_WRITE = 23
#: The slot files (device, inode) this process loaded parts of copy-on-write. Truncating a
#: file takes even the copied pages of its private mappings past the new end (touching them
#: then is a SIGBUS): these files are never made shorter (``SlotWriter``).
_mapped: set[tuple[int, int]] = set()
#: The copy-on-write mappings of loaded parts whose pages may still be their file's.
_uncopied: list[weakref.ref[mmap.mmap]] = []


def _copied_pages(fd: int, offset: int, length: int) -> memoryview | None:
    """``length`` bytes of the file ``fd`` from ``offset`` as private memory of their own: the
    file's pages mapped copy-on-write. A page is copied when the worker first writes it, or
    every page still shared at this process's next save or fork (``_own_pages``), so a save
    over the slot never changes what was loaded. A worker that copies what it loaded
    elsewhere (a GPU model's ``load_state_dict``) and drops it copies nothing: 4 ranks'
    201 MB loaded and copied into parameters in 0.06-0.2 s, against 0.9-1.7 s when the load
    copied every page first. None where the kernel cannot copy a mapping's pages on demand
    (the caller reads the part instead)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(
            fd,
            offset + length - start,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=start,
        )
    except (OSError, ValueError):
        return None
    stat = os.fstat(fd)
    _mapped.add((stat.st_dev, stat.st_ino))
    try:
        mapped.madvise(_POPULATE_WRITE, 0, mmap.PAGESIZE)  # the kernel can copy them later
    except OSError:  # an older kernel, or the slot shrank meanwhile
        mapped.close()
        return None
    _uncopied.append(weakref.ref(mapped))
    return memoryview(mapped)[offset - start : offset - start + length]


def _own_pages() -> None:
    """Copy every page a load left shared with its slot file: before a save (one over that
    file would change them; waiting for that one costs more, as the agent copies the save
    before it to another node meanwhile) and before a fork (the child would keep sharing
    them with the file)."""
    while _uncopied:  # one that fails (no memory) stays listed: the save fails, not the load
        mapped = _uncopied[-1]()
        if mapped is not None and not mapped.closed:
            mapped.madvise(_POPULATE_WRITE)
        _uncopied.pop()


os.register_at_fork(before=_own_pages)


def _read_into(fd: int, part: bytearray | memoryview, offset: int) -> None:
    view = memoryview(part)
    while view:
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise StateCorrupt("the slot ends before its header says")
        view, offset = view[got:], offset + got


class SlotWriter:
    """A worker's slot file, mapped: a save is a ``memcpy`` into pages the file already has
    (after its first save of that size) and the mapping already shows, with no system call or
    page fault per part. Its memory is reserved (``posix_fallocate``) before it is written, so
    a full ``/dev/shm`` is an ``OSError`` here, never a SIGBUS in the middle of a save."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None

    def write(self, step: int, generation: int, parts: Sequence[memoryview], flags: int = 0) -> int:
        """Write ``parts`` and commit them as ``step``: the commit flag is cleared first and
        set last, each one aligned 4-byte store, so a death in between leaves an uncommitted
        slot. Returns the slot's bytes in use."""
        lengths = [part.nbytes for part in parts]
        *starts, used = part_offsets(lengths)
        mapped = self._reserve(used)
        _own_pages()
        with memoryview(mapped) as view:
            view[COMMITTED : COMMITTED + 4] = b"\0\0\0\0"
            view[:HEADER_SIZE] = header(step, generation, lengths, committed=False, flags=flags)
            offset = HEADER_SIZE
            for length in lengths:
                LENGTH.pack_into(view, offset, length)
                offset += LENGTH.size
            for part, offset in zip(parts, starts, strict=True):
                view[offset : offset + part.nbytes] = part.cast("B")
            view[COMMITTED : COMMITTED + 4] = b"\1\0\0\0"
        return used

    def _reserve(self, used: int) -> mmap.mmap:
        stat = os.fstat(self.fd)
        size = stat.st_size
        shrinks = size > 2 * used and (stat.st_dev, stat.st_ino) not in _mapped
        if size < used or shrinks:  # grow, or give back what a larger state took
            self.close()
            os.ftruncate(self.fd, used)
            os.posix_fallocate(self.fd, 0, used)
            size = used
        if self._map is None:
            # Its page tables made at once (``MAP_POPULATE``): the first save of a process
            # (every restarted worker's) would otherwise fault in the slot's pages one by one
            # as it copies, 0.11 s for 201 MB, against 0.02 s for this mapping and then 0.02 s
            # for the copy.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(self.fd, size, flags=flags)
        return self._map

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def uncommit(path: str) -> None:
    """Clear the commit flag of the slot file ``path``: no load takes it from now on."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return
    try:
        write_all(fd, bytes(4), COMMITTED)
    finally:
        os.close(fd)


def slot_header(fd: int) -> Header | None:
    """The header of the slot ``fd`` when it is committed."""
    return read_header(os.pread(fd, HEADER_SIZE, 0))


def read_slot(fd: int, expected: Header, own: bool = False) -> list[bytearray | memoryview]:
    """The parts of the committed slot ``fd`` whose header was ``expected``: the pickle, then
    its buffers, each in writable memory of its own: mapped copy-on-write (``_copied_pages``)
    from a slot of the rank's ``own``, which only this process writes to, else read
    (``_part_memory``: another process may shorten its file). ``StateCorrupt`` when
    the slot changed meanwhile or does not match its header."""
    table = os.pread(fd, LENGTH.size * expected.parts, HEADER_SIZE)
    if len(table) != LENGTH.size * expected.parts:
        raise StateCorrupt("the slot ends inside its length table")
    lengths = [LENGTH.unpack_from(table, at)[0] for at in range(0, len(table), LENGTH.size)]
    *starts, end = part_offsets(lengths)
    if end - HEADER_SIZE != expected.payload:
        raise StateCorrupt("the slot's lengths do not add up to its header's")
    parts: list[bytearray | memoryview] = []
    for length, offset in zip(lengths, starts, strict=True):
        copied = _copied_pages(fd, offset, length) if own and length >= MAPPED_PART else None
        if copied is not None:
            parts.append(copied)
        else:
            parts.append(_part_memory(length))
            _read_into(fd, parts[-1], offset)
    again = slot_header(fd)
    if again is None or again.generation != expected.generation:
        raise StateCorrupt("the slot was rewritten while it was read")
    return parts


def committed(directory: str, rank: int) -> dict[int, Header]:
    """The committed slots of ``rank`` in ``directory``, by slot number."""
    found = {}
    for slot in SLOTS:
        head = file_header(os.path.join(directory, slot_name(rank, slot)))
        if head is not None:
            found[slot] = head
    return found


def file_header(path: str) -> Header | None:
    """The header of the slot file ``path`` when it is there and committed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return slot_header(fd)
    finally:
        os.close(fd)


def find_replica(directory: str, step: int) -> str | None:
    """A slot file in ``directory`` with a replicated save of ``step`` (any rank's)."""
    with os.scandir(directory) as entries:
        names = sorted(entry.name for entry in entries if entry.name.startswith("rank"))
    for name in names:
        head = file_header(os.path.join(directory, name))
        if head is not None and head.replicated and head.step == step:
            return os.path.join(directory, name)
    return None


def copy_committed(source: str, target: str, fsync: bool) -> Header | None:
    """Copy the committed slot file ``source`` to ``target`` through a temporary file renamed
    into place (a reader never sees half of it); None, and nothing written, when ``source``
    holds no committed state or it was rewritten while copied. ``OSError`` from the target's
    file system (a full disk) leaves the old ``target`` as it was."""
    try:
        fd = os.open(source, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        head = slot_header(fd)
        if head is None:
            return None
        temporary = f"{target}.tmp{os.getpid()}"
        out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _copy(fd, out, head, fsync)
        except BaseException as exc:
            os.close(out)
            os.unlink(temporary)
            if isinstance(exc, StateCorrupt):
                return None
            raise
        os.close(out)
        os.replace(temporary, target)
        return head
    finally:
        os.close(fd)


def _copy(fd: int, out: int, head: Header, fsync: bool) -> None:
    """The ``head.size`` bytes of slot ``fd`` into ``out``; ``StateCorrupt`` when the slot was
    rewritten meanwhile. Kernel to kernel (``sendfile``: one copy, where reading and writing
    through a buffer makes two), or through a buffer where ``sendfile`` cannot."""
    offset = 0
    try:
        while offset < head.size:
            sent = os.sendfile(out, fd, offset, head.size - offset)
            if sent == 0:
                raise StateCorrupt("the slot ends before its header says")
            offset += sent
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS) or offset:
            raise
        chunk = bytearray(min(head.size, 8 << 20))
        while offset < head.size:
            view = memoryview(chunk)[: min(len(chunk), head.size - offset)]
            _read_into(fd, view, offset)
            write_all(out, view, offset)
            offset += len(view)
    again = slot_header(fd)
    if again is None or again.generation != head.generation:
        raise StateCorrupt("the slot was rewritten while it was copied")
    if fsync:
        os.fsync(out)


def find_slot(directory: str, rank: int, step: int) -> str | None:
    """A committed slot file in ``directory`` holding ``rank``'s state of ``step``: the rank's
    own, a peer copy, or any rank's replicated save (newest first)."""
    candidates = []
    for where in (directory, os.path.join(directory, PEERS)):
        for slot in SLOTS:
            path = os.path.join(where, slot_name(rank, slot))
            head = file_header(path)
            if head is not None and head.step == step:
                candidates.append((head.generation, path))
    if candidates:
        return max(candidates)[1]
    return find_replica(directory, step)


def slot_files(directory: str) -> Iterator[tuple[int, str, Header]]:
    """Every committed slot file of the state directory ``directory``, the ranks' own and the
    peer copies: (its rank, its path, its header)."""
    for where in (directory, os.path.join(directory, PEERS)):
        try:
            names = os.listdir(where)
        except FileNotFoundError:
            continue
        for name in names:
            rank, _, slot = name.removeprefix("rank").partition(".")
            if not name.startswith("rank") or not rank.isdigit() or not slot.isdigit():
                continue
            path = os.path.join(where, name)
            head = file_header(path)
            if head is not None:
                yield int(rank), path, head


def held_steps(directory: str, coming: Mapping[int, Header] | None = None) -> dict[int, list[int]]:
    """Every rank's steps this node holds: its own ranks' and the peer copies, and ``coming``
    (by rank: saves on their way from disk); a replicated save stands for every rank listed
    (``replicated_steps`` for the others)."""
    own: dict[int, list[Header]] = {rank: [head] for rank, head in (coming or {}).items()}
    for rank, _, head in slot_files(directory):
        own.setdefault(rank, []).append(head)
    return steps_held(own)


def replicated_steps(held_here: dict[int, list[int]], directory: str) -> list[int]:
    """The steps of which this node holds a replicated save (any rank's): any rank of the world
    may resume from them."""
    steps = set()
    for rank in held_here:
        for where in (directory, os.path.join(directory, PEERS)):
            for slot in SLOTS:
                head = file_header(os.path.join(where, slot_name(rank, slot)))
                if head is not None and head.replicated:
                    steps.add(head.step)
    return sorted(steps)


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
