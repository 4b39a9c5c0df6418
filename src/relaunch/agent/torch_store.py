"""torch's store served by the agent, as torchrun's agent serves it
(``TORCHELASTIC_USE_AGENT_STORE=True``), where ``--preload`` imports torch.

Without it, worker rank 0 serves torch's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` once its
``init_process_group`` runs, and a rank that asks earlier is refused: torch's client tries again
only after about half a second, which a restart paid whenever a rank of another node started
before rank 0. With it, the agent of group rank 0 binds ``MASTER_PORT`` and listens as the
attempt starts (``bind``), before its state record lets the other nodes start their workers,
and a process forked from the zygote, which has torch already, serves the store on that socket
(``serve``): a rank that asks before it serves waits in the socket's backlog, never refused. One
server an attempt, stopped with the attempt's workers (``stop``): the next attempt's workers
find a new, empty store.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

from relaunch.core.run.failures import describe_exit

if TYPE_CHECKING:
    from relaunch.procs.zygote import Zygote
    from relaunch.procs.zygote_handle import ZygoteHandle

log = logging.getLogger(__name__)

#: Seconds the server's own client waits on it (it asks nothing: torch's constructor needs one).
CLIENT_TIMEOUT = 60.0
#: Seconds a new server may take to serve (a fork and a ``TCPStore``: milliseconds).
READY_TIMEOUT = 30.0
#: Seconds to wait for a killed server to be gone (a SIGKILLed process ends at once).
STOP_TIMEOUT = 10.0
#: Connections the kernel holds for the server before it accepts them: every rank's at once.
BACKLOG = 4096


def serves_torch_store(preload: Sequence[str]) -> bool:
    """Whether the agents serve torch's store: ``--preload`` imports torch."""
    return any(name.partition(".")[0] == "torch" for name in preload)


def listen(port: int) -> socket.socket | None:
    """A socket listening on ``port`` of every address, as torch's ``TCPStore`` listens (IPv6
    and IPv4 where the host has IPv6); None when the port is taken (worker rank 0 then serves
    the store, as without ``--preload torch``, and says why it cannot)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((address, port))
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            if family == socket.AF_INET6 and exc.errno != errno.EADDRINUSE:
                continue
            log.warning("cannot serve torch's store on port %d: %s", port, exc.strerror or exc)
            return None
        return sock
    return None


class TorchStoreServer:
    """torch's store for each attempt of this node's workers, while this node is group rank 0:
    ``bind`` then ``serve`` at the attempt's start, ``stop`` at its end."""

    def __init__(self, zygote: Zygote) -> None:
        self._zygote = zygote
        self._listener: socket.socket | None = None
        self._server: ZygoteHandle | None = None

    def bind(self, port: int) -> None:
        """Listen on ``port`` from now on (the last attempt's server stopped first)."""
        self.stop()
        self._listener = listen(port)

    def serve(self, host: str, port: int) -> bool:
        """Have a process forked from the zygote serve the store on the socket ``bind`` made
        (``host``: where its clients find it), and wait until it does; whether it does. When
        it does not, the socket is closed: a rank waiting on it is refused and tries again, and
        worker rank 0 serves the store, as without ``--preload torch``."""
        listener, self._listener = self._listener, None
        if listener is None:
            return False
        ready_r, ready_w = os.pipe()
        try:
            with listener:
                try:
                    self._server = self._zygote.serve_torch_store(
                        listener.fileno(), ready_w, host, port, CLIENT_TIMEOUT
                    )
                finally:
                    os.close(ready_w)
            if self._server is None:
                return False
            readable, _, _ = select.select([ready_r], [], [], READY_TIMEOUT)
            if readable and os.read(ready_r, 1):
                return True
        finally:
            os.close(ready_r)
        log.warning(
            "torch's store could not be served by the agent (%s): worker rank 0 serves it",
            "its error above" if readable else f"not serving after {READY_TIMEOUT:g}s",
        )
        self.stop()
        return False

    @property
    def pid(self) -> int | None:
        """The attempt's server process (None: none serves)."""
        return None if self._server is None else self._server.pid

    def ended(self) -> str | None:
        """What a failure report adds when the attempt's server ended before the attempt did
        (killed, say, by the out-of-memory killer): from then on, every rank's call to torch's
        store failed. None while it serves (or none was started)."""
        server = self._server
        if server is None or (code := server.poll()) is None:
            return None
        return (
            f"torch's store, served by this agent (pid {server.pid}), {describe_exit(code)} "
            "during the attempt: every rank's call to the store failed from then on "
            "(the next attempt has a new one)"
        )

    def stop(self) -> None:
        """The attempt's workers are gone: stop serving (the port is free again when this
        returns, for the next attempt where the port is fixed)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        server, self._server = self._server, None
        if server is None:
            return
        server.kill()
        if server.wait(STOP_TIMEOUT) is None:
            log.warning("torch's store server (pid %d) did not end after SIGKILL", server.pid)
        server.release()
