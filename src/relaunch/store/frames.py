"""How the built-in store receives its clients' frames: a client's bytes into whole frames,
and large frames only within ``FRAME_BUDGET``, shared by every client (``store.server``).

After authenticating, a connection holds at most one read (``_RECV_SIZE``) of small frames; a
larger frame is received only once its announced size is reserved in ``FRAME_BUDGET`` (first
come, first served; until its frame fits, the client is not read), so that large values cannot
add up past it whatever the number of connections.
"""

from __future__ import annotations

import mmap
import struct
from collections import deque
from collections.abc import Callable

import relaunch.store.wire as wire
from relaunch.store.operations import Client

#: The largest frame a client may send before it authenticates (that frame is ~80 bytes).
PRE_AUTH_LIMIT = 4096
#: Bytes of frames larger than one read that all clients together may have in the server's
#: buffers at once: room for four of the largest frames.
FRAME_BUDGET = 4 * wire.MAX_FRAME
_RECV_SIZE = 1 << 16
_LENGTH = struct.Struct(">I")


class _Refused(Exception):
    """A client to close, with a reason for the log: ``reason`` sums it up, ``detail`` says it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class Frames:
    """Assembles the clients' frames; ``resumed(client)``: a starving client got its budget
    (read it again)."""

    def __init__(self, resumed: Callable[[Client], None]) -> None:
        self._resumed = resumed
        self.reserved = 0  # bytes of FRAME_BUDGET held
        self.starving: deque[Client] = deque()  # large frames waiting for FRAME_BUDGET

    def take(self, client: Client, data: memoryview) -> None:
        """Assemble ``data`` into ``client``'s frames. A frame larger than one read must fit in
        FRAME_BUDGET first: until it does, the client starves (is not read)."""
        partial, at, end = client.partial, 0, len(data)
        while True:
            if client.size < 0:
                take = min(4 - len(partial), end - at)
                partial += data[at : at + take]
                at += take
                if len(partial) < 4:
                    return
                client.size = self._announced(client, _LENGTH.unpack(partial)[0])
                if client.size + 4 > _RECV_SIZE:
                    self._reserve(client, client.size + 4)
            body = client.body
            if body is not None:
                take = min(client.size - client.filled, end - at)
                body[client.filled : client.filled + take] = data[at : at + take]
                client.filled += take
                at += take
                if client.filled < client.size:
                    return
                self.complete(client, body)
            else:
                take = min(client.size + 4 - len(partial), end - at)
                partial += data[at : at + take]
                at += take
                if len(partial) < client.size + 4:
                    return
                client.frames.append(bytes(partial[4:]))
                partial.clear()  # frees its memory: an idle connection keeps no buffer
                client.size = -1

    @staticmethod
    def _announced(client: Client, size: int) -> int:
        """A frame's announced size, or ``_Refused`` if it is too large for the client now."""
        if client.authenticated:
            if size > wire.MAX_FRAME:
                raise _Refused(
                    "oversized frames", f"frame of {size} bytes exceeds {wire.MAX_FRAME}"
                )
        elif size > PRE_AUTH_LIMIT:
            raise _Refused(
                "oversized frames before authenticating",
                f"a frame of {size} bytes before authenticating (at most {PRE_AUTH_LIMIT})",
            )
        return size

    def complete(self, client: Client, body: mmap.mmap) -> None:
        client.frames.append(body)
        client.body = None
        client.size = -1
        client.filled = 0

    def _begin_body(self, client: Client) -> None:
        """``client``'s large frame got its reservation: its buffer, with what came already."""
        received = len(client.partial) - 4
        client.body = mmap.mmap(-1, client.size)
        client.body[:received] = client.partial[4:]
        client.filled = received
        client.partial.clear()

    def _reserve(self, client: Client, size: int) -> None:
        """Reserve ``size`` bytes of FRAME_BUDGET for ``client``'s frame, or make it wait its
        turn (clients that wait are served in order; one frame alone always fits)."""
        if not self.starving and (self.reserved == 0 or self.reserved + size <= FRAME_BUDGET):
            self.reserved += size
            client.reserved += size
            self._begin_body(client)
        else:
            client.starving = True
            self.starving.append(client)

    def release(self, client: Client, size: int) -> None:
        """``client`` gave back ``size`` bytes of FRAME_BUDGET: let the frames waiting in."""
        client.reserved -= size
        self.reserved -= size
        while self.starving:
            waiting = self.starving[0]
            if waiting.sock.fileno() < 0:
                self.starving.popleft()
                continue
            need = waiting.size + 4
            if self.reserved and self.reserved + need > FRAME_BUDGET:
                break
            self.starving.popleft()
            self.reserved += need
            waiting.reserved += need
            waiting.starving = False
            self._begin_body(waiting)
            self._resumed(waiting)
