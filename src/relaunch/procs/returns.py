"""A function worker's return value, sent by value from the worker to the launcher.

The worker pickles the value with the standard pickler (protocol 5: large buffers such as numpy
arrays go out of band, unjoined; a plain CPU tensor's storage too, see ``relaunch.pickling``) and
writes one frame to a pipe: a header naming the value's type and the length of each part, the
pickle, the buffers. By value, because the launcher reads the value after the worker exited:
multiprocessing's own pickler (which torch extends) shares a tensor's storage through a file
descriptor that only a live sender can serve.

The launcher's monitor reads the frame as it arrives (``ReturnReader.read``), into one buffer
allocated once the header gives the size, so each byte is copied once and a worker never blocks
on a full pipe while the launcher waits for it to exit. The caller's thread loads it
(``ReturnReader.load``), as torch's ``wait()`` does: unpickling runs the user's code (imports,
``__setstate__``), which must neither stall nor kill the thread that watches the workers.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

#: magic, number of out-of-band buffers, length of the type's name.
_HEAD = struct.Struct("!4sIH")
_MAGIC = b"RLRV"
_LENGTH = struct.Struct("!Q")
#: More buffers than this is not a frame relaunch wrote.
_MAX_BUFFERS = 1 << 24
#: A pipe this large (Linux allows up to /proc/sys/fs/pipe-max-size, 1 MiB by default
#: unprivileged) lets a large value through in 16 times fewer wake-ups than the default 64 KiB.
PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031


class ReturnValueError(Exception):
    """A worker's return value that cannot be sent (raised in the worker) or loaded (raised in
    the launcher); the message says which value and what to do."""


def type_name(value: object) -> str:
    """``module.QualName`` of ``value``'s type (builtins bare), as a message names it."""
    kind = type(value)
    module = getattr(kind, "__module__", "") or ""
    name = getattr(kind, "__qualname__", kind.__name__)
    return name if module == "builtins" else f"{module}.{name}"


def widen_pipe(fd: int) -> None:
    """Make the pipe of ``fd`` ``PIPE_SIZE`` bytes where the system allows it (else keep it)."""
    try:
        import fcntl

        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
    except (ImportError, OSError):
        pass


def send_return_value(fd: int, value: object, what: str) -> None:
    """Write ``value`` to the pipe ``fd`` as one frame (in the worker). ``what`` names the
    returning function in the error raised when the value cannot be pickled."""
    from relaunch.pickling import dump_parts

    try:
        data, *buffers = dump_parts(value)
    except Exception as exc:
        raise ReturnValueError(
            f"{what} returned a {type_name(value)}, which cannot be sent to the launcher: "
            f"{type(exc).__name__}: {exc}; return plain data (numbers, strings, lists, dicts, "
            "tensors, arrays), not what holds a live resource (a generator, a lambda, a socket, "
            "an open file, a lock)"
        ) from exc
    name = type_name(value).encode("utf-8", errors="replace")[:0xFFFF]
    lengths = b"".join(_LENGTH.pack(len(part)) for part in (data, *buffers))
    head = _HEAD.pack(_MAGIC, len(buffers), len(name)) + name + lengths
    parts: list[bytes | memoryview] = [head, data, *buffers]
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view) :]


class ReturnReader:
    """The launcher's end of one worker's return-value pipe: ``read`` takes what has arrived
    (the fd is non-blocking), ``load`` gives the value once the worker ended."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.type_name = ""
        self._head = bytearray()
        self._parts: list[int] | None = None
        self._data: bytearray | None = None
        self._filled = 0
        self._ended = False
        self._loaded = False

    @property
    def received(self) -> int:
        """How many bytes arrived so far."""
        return len(self._head) + self._filled

    @property
    def complete(self) -> bool:
        return self._data is not None and self._filled == len(self._data)

    @property
    def done(self) -> bool:
        """Nothing more will be read: the frame is complete, or the pipe ended or failed."""
        return self.complete or self._ended

    def read(self, limit: int) -> bool:
        """Read what has arrived, up to about ``limit`` bytes; returns ``done``."""
        try:
            while not self.done and limit > 0:
                if self._data is None:
                    chunk = os.read(self.fd, self._head_missing())
                    if not chunk:
                        self._ended = True
                        break
                    self._head += chunk
                    self._parse_head()
                else:
                    got = os.readv(self.fd, [memoryview(self._data)[self._filled :]])
                    if not got:
                        self._ended = True
                        break
                    self._filled += got
                    limit -= got
        except BlockingIOError:
            pass
        except OSError:
            self._ended = True
        return self.done

    def _head_missing(self) -> int:
        if len(self._head) < _HEAD.size:
            return _HEAD.size - len(self._head)
        count: int
        name_length: int
        _, count, name_length = _HEAD.unpack_from(self._head)
        return _HEAD.size + name_length + _LENGTH.size * (count + 1) - len(self._head)

    def _parse_head(self) -> None:
        if len(self._head) < _HEAD.size:
            return
        magic, count, _ = _HEAD.unpack_from(self._head)
        if magic != _MAGIC or count > _MAX_BUFFERS:
            self._ended = True  # not a frame: ``load`` says so
            return
        if self._head_missing():
            return
        name_end = len(self._head) - _LENGTH.size * (count + 1)
        self.type_name = self._head[_HEAD.size : name_end].decode("utf-8", errors="replace")
        self._parts = [
            _LENGTH.unpack_from(self._head, offset)[0]
            for offset in range(name_end, len(self._head), _LENGTH.size)
        ]
        self._data = bytearray(sum(self._parts))

    def load(self, who: str) -> Any:
        """The value (None when the worker sent nothing). Raises ``ReturnValueError`` naming
        ``who`` when it arrived incomplete or cannot be unpickled here. Once only: the frame's
        buffer is let go (the value may still hold parts of it)."""
        if self._loaded:
            raise RuntimeError("a return value is loaded once")
        self._loaded = True
        if self.received == 0:
            return None
        if not self.complete or self._parts is None or self._data is None:
            expected = "?" if self._data is None else str(len(self._head) + len(self._data))
            raise ReturnValueError(
                f"{who}'s return value arrived incomplete ({self.received} of {expected} bytes): "
                "the worker ended while sending it"
            )
        view = memoryview(self._data)
        self._data = None
        pieces = []
        start = 0
        for length in self._parts:
            pieces.append(view[start : start + length])
            start += length
        import pickle

        try:
            return pickle.loads(pieces[0], buffers=pieces[1:])
        except Exception as exc:
            raise ReturnValueError(
                f"{who} returned a {self.type_name} the launcher cannot load: "
                f"{type(exc).__name__}: {exc}; return plain data or a type importable in the "
                "launcher"
            ) from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
