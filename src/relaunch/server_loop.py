"""One selector thread serving sockets: every server relaunch runs (the built-in store, the
metrics endpoint, the parking lot, the state peers) is a ``ServerLoop`` with handlers.

A loop watches its sockets and a wake-up pipe (``wake``, from any thread), runs timers (``call_at``:
whole-request deadlines, back-offs, summaries) from a heap, and runs in a thread started by
``runtime.start_thread``: an exception that ends it is a reported thread failure, never a silent
death. A ``Listener`` accepts a bounded number of connections a turn, asks its owner's ``admit``
first, while a client waits (a connection cap: the owner rests the listener until one closes, or
makes room), and out of descriptors (``EMFILE``) rests a while instead of spinning. Everything it
needs is imported here, not where first used: an import opens a file, which the back-off from
``EMFILE`` would not get.

A listener a worker may reach is bound before the workers start (``bind_tcp``, ``bind_unix``: a
worker that connects first waits in its backlog) and served once they started: these bind with
``_socket`` alone, and ``adopt`` loads ``socket`` (2 ms of imports) off the workers' start.
"""

from __future__ import annotations

import _socket
import errno
import heapq
import itertools
import logging
import os
import select
import selectors
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relaunch.runtime import SYSTEM_CLOCK, Clock, start_thread

if TYPE_CHECKING:
    import socket  # an agent without metrics loads no network code

log = logging.getLogger(__name__)

#: Errors of ``accept`` that mean the process (or the system) is out of descriptors or memory.
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: The longest one select() sleeps: epoll refuses timeouts over ~24.8 days.
_MAX_SELECT = 3600.0

#: Connections the kernel holds for a TCP listener before they are accepted: every rank's at
#: once.
TCP_BACKLOG = 4096

Handler = Callable[[int], None]


def bind_tcp(port: int, host: str | None, backlog: int = TCP_BACKLOG) -> tuple[int | None, str]:
    """A descriptor listening on TCP ``port``: of ``host`` alone where it is a loopback address
    (``127.x.y.z`` or ``::1``), else of every address (IPv6 and IPv4 where the host has IPv6,
    IPv4 alone where not); or None and why the port cannot be bound."""
    places = [(_socket.AF_INET6, "::"), (_socket.AF_INET, "0.0.0.0")]
    if host is not None and host.startswith("127."):
        places = [(_socket.AF_INET, host)]
    elif host == "::1":
        places = [(_socket.AF_INET6, host)]
    why = "no address to bind"
    for family, address in places:
        try:
            sock = _socket.socket(family, _socket.SOCK_STREAM)
        except OSError as exc:
            why = exc.strerror or str(exc)
            continue
        try:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            if address == "::":
                sock.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 0)
            sock.bind((address, port))
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            why = exc.strerror or str(exc)
            if address == "::" and exc.errno != errno.EADDRINUSE:
                continue  # a host without IPv6
            return None, why
        return sock.detach(), ""
    return None, why


def bind_unix(path: str, backlog: int) -> int:
    """A descriptor listening on a new Unix ``SOCK_SEQPACKET`` socket at ``path``, mode 0600."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    try:
        previous = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(previous)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def adopt(descriptor: int) -> socket.socket:
    """The socket of a ``bind_tcp`` or ``bind_unix`` descriptor, to serve."""
    import socket  # once the workers started: not on their way

    return socket.socket(fileno=descriptor)


class Timer:
    """An action due at ``when`` on a loop's thread; ``cancel`` before it is run."""

    __slots__ = ("action", "cancelled", "when")

    def __init__(self, when: float, action: Callable[[], None]) -> None:
        self.when, self.action, self.cancelled = when, action, False

    def cancel(self) -> None:
        self.cancelled = True


class ServerLoop:
    """A selector, a wake-up pipe and a timer heap, served by one thread (``start``) until
    ``stop``. Handlers run on that thread: ``register(sock, events, handler)`` calls
    ``handler(mask)`` when the socket is ready; ``on_wake`` runs after each ``wake``;
    ``after_events`` runs each turn after the ready handlers, before the timers due."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._wake_lock = threading.Lock()  # a wake never writes to a pipe closed under it
        #: (when, tie-break, timer); cancelled ones stay until popped or rebuilt away.
        self.timers: list[tuple[float, int, Timer]] = []
        self.sequence = itertools.count()  # timers ever pushed, counted
        self._soon: list[Callable[[], None]] = []  # ``call_soon``'s, under the wake lock
        self.on_wake: Callable[[], None] | None = None
        self.after_events: Callable[[], None] | None = None
        self.on_end: Callable[[], None] | None = None  # last, on the loop's thread
        self.stopping = False
        self._close_at_end = False
        self._ended = False
        self.thread: threading.Thread | None = None

    # -- sockets -----------------------------------------------------------------------------

    def register(self, sock: Any, events: int, handler: Handler) -> None:
        self.selector.register(sock, events, handler)

    def modify(self, sock: Any, events: int, handler: Handler) -> None:
        self.selector.modify(sock, events, handler)

    def unregister(self, sock: Any) -> None:
        """Stop watching ``sock`` (nothing if it was not watched)."""
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass

    # -- timers ------------------------------------------------------------------------------

    def call_at(self, when: float, action: Callable[[], None], live: int = 0) -> Timer:
        """Run ``action`` on the loop's thread at ``when`` (``clock.monotonic``). ``live``: how
        many timers at most are not cancelled (when known): the heap is rebuilt without the
        cancelled ones once they outnumber the live, so that it stays O(live)."""
        timer = Timer(when, action)
        heapq.heappush(self.timers, (when, next(self.sequence), timer))
        if live and len(self.timers) > 2 * live + 64:
            self.timers = [entry for entry in self.timers if not entry[2].cancelled]
            heapq.heapify(self.timers)
        return timer

    def call_later(self, delay: float, action: Callable[[], None]) -> Timer:
        return self.call_at(self.clock.monotonic() + delay, action)

    def _next_timeout(self) -> float | None:
        timers = self.timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)
        if not timers:
            return None
        return min(max(0.0, timers[0][0] - self.clock.monotonic()), _MAX_SELECT)

    def _run_timers(self) -> None:
        timers, now = self.timers, self.clock.monotonic()
        while timers and timers[0][0] <= now and not self.stopping:
            timer = heapq.heappop(timers)[2]
            if not timer.cancelled:
                timer.cancelled = True
                timer.action()

    # -- the thread --------------------------------------------------------------------------

    def wake(self) -> None:
        """Wake the loop (any thread): ``on_wake`` runs on it soon."""
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass  # a wake is pending already

    def call_soon(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the loop's thread soon (any thread)."""
        with self._wake_lock:
            self._soon.append(action)
        self.wake()

    def _run_soon(self) -> None:
        with self._wake_lock:
            actions, self._soon = self._soon, []
        for action in actions:
            action()

    def start(self, name: str, target: Callable[[], None] | None = None) -> threading.Thread:
        """Serve on a thread of its own: ``run``, or ``target`` (which calls it)."""
        self.thread = start_thread(target or self.run, name)
        return self.thread

    def run(self) -> None:
        """Serve until ``stop`` (the loop's thread), then ``on_end``."""
        try:
            self._turns()
        finally:
            self.stopping = True
            try:
                if self.on_end is not None:
                    self.on_end()
            finally:
                with self._wake_lock:
                    self._ended, release = True, self._close_at_end
                if release:
                    self._release()

    def _turns(self) -> None:
        while not self.stopping:
            for key, mask in self.selector.select(self._next_timeout()):
                handler = key.data
                if handler is None:
                    try:
                        os.read(self._wake_r, 512)
                    except BlockingIOError:
                        pass
                    self._run_soon()
                    if self.on_wake is not None:
                        self.on_wake()
                else:  # unless an earlier handler of this turn closed or changed it
                    registered = self.selector.get_map().get(key.fd)
                    if registered is not None and registered.data is handler:
                        handler(mask)
            if self.after_events is not None:
                self.after_events()
            self._run_timers()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop's thread within its turn and wait for it (``timeout``), unless called
        from it; the pipe is closed once the thread ended (a ``run`` that ends by ``stop``)."""
        self.stopping = True
        self.wake()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def close(self) -> None:
        """Release the selector and the wake-up pipe: now if the thread ended or never ran,
        else by the thread when it ends."""
        with self._wake_lock:
            if self.thread is not None and not self._ended:
                self._close_at_end = True
                return
        self._release()

    def _release(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return
            os.close(self._wake_w)
            self._wake_w = -1
        os.close(self._wake_r)
        self.selector.close()


class Listener:
    """A listening socket served on ``loop``: each turn, up to ``per_turn`` connections go to
    ``accept(sock, address)``, each once ``admit(now)`` allows it, asked only while one waits (a
    cap: the owner may ``rest`` the listener, or make room and allow). Out of descriptors with
    clients waiting, ``short(error)`` is told once an episode (``recovered()`` at its end) and the
    listener rests ``backoff`` seconds or until ``resume``. ``on_error(error)``, if given, is asked
    first about any failed accept (true: handled, e.g. a connection closed to make room: go on
    accepting)."""

    def __init__(
        self,
        loop: ServerLoop,
        sock: socket.socket,
        accept: Callable[[socket.socket, Any], None],
        *,
        name: str = "server",
        admit: Callable[[float], bool] | None = None,
        per_turn: int = 64,
        backoff: float = 0.5,
        short: Callable[[OSError], None] | None = None,
        recovered: Callable[[], None] | None = None,
        on_error: Callable[[OSError], bool] | None = None,
    ) -> None:
        self.loop, self.sock, self.name = loop, sock, name
        self._accept, self._admit, self._per_turn = accept, admit, per_turn
        self.backoff = backoff
        self._short, self._recovered, self._on_error = short, recovered, on_error
        self._queue = select.poll()  # whether clients wait to be accepted (no descriptor used)
        self._queue.register(sock, select.POLLIN)
        self.shortage = False  # in an episode of failed accepts
        self.accepting = True
        self._resume_timer: Timer | None = None
        sock.setblocking(False)
        loop.register(sock, selectors.EVENT_READ, self._ready)

    def _ready(self, mask: int) -> None:
        for _ in range(self._per_turn):
            if not self._queue.poll(0):  # nobody waits: an owner makes room for no one
                self._end_shortage()
                return
            if self._admit is not None and not self._admit(self.loop.clock.monotonic()):
                return
            try:
                sock, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                self._end_shortage()
                return
            except ConnectionAbortedError:
                continue  # the client gave up before it was taken
            except OSError as exc:
                if self._on_error is not None and self._on_error(exc):
                    continue
                self._failed(exc)
                return
            self._accept(sock, address)
            if not self.accepting:  # rested by the owner (e.g. out of threads)
                return

    def _failed(self, exc: OSError) -> None:
        if exc.errno not in OUT_OF_DESCRIPTORS:  # keep serving the others
            log.warning("%s: cannot accept a connection: %s", self.name, exc)
        elif self._queue.poll(0):  # clients wait in the kernel's queue
            if not self.shortage and self._short is not None:
                self._short(exc)
            self.shortage = True
            self.rest(self.loop.clock.monotonic() + self.backoff)
        else:  # only at the limit: Linux refuses before it looks at the queue
            self._end_shortage()

    def _end_shortage(self) -> None:
        if self.shortage:
            self.shortage = False
            if self._recovered is not None:
                self._recovered()

    def rest(self, until: float | None) -> None:
        """Stop watching the listener (it would stay readable: no busy loop) until ``until``
        (None: until ``resume``)."""
        if self.accepting:
            self.loop.unregister(self.sock)
            self.accepting = False
        if self._resume_timer is not None:
            self._resume_timer.cancel()
        self._resume_timer = None if until is None else self.loop.call_at(until, self.resume)

    def resume(self) -> None:
        """Watch the listener again (a connection closed, or the rest is over)."""
        if self._resume_timer is not None:
            self._resume_timer.cancel()
            self._resume_timer = None
        if not self.accepting and not self.loop.stopping:
            self.loop.register(self.sock, selectors.EVENT_READ, self._ready)
            self.accepting = True

    @property
    def resting_until(self) -> float | None:
        """When a timed rest ends (None: not resting, or until ``resume``)."""
        return None if self._resume_timer is None else self._resume_timer.when
