"""The built-in store's operations on its ``KeyValueData`` (``store.server`` reads the frames
and sends the replies): what each request does, and the waiters of ``WAIT`` and ``WATCH``.

Blocking operations park the connection as a waiter with a deadline; any change to a key wakes
exactly the waiters on that key.
"""

from __future__ import annotations

import mmap
import selectors
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import relaunch.store.wire as wire
from relaunch.server_loop import Timer
from relaunch.store.api import StoreError, StoreProtocolError
from relaunch.store.data import KeyValueData

#: Longer WAIT/WATCH timeouts (in ms) are clamped to this: any decimal integer then fits a float.
_MAX_PARK_MS = 365 * 86400 * 1000


@dataclass(eq=False, slots=True)
class Client:
    """One connection to the store, and what the server holds for it."""

    sock: socket.socket
    peer: str
    nonce: bytes
    accepted: float = 0.0
    # What it sent and was not handled yet: complete frames' payloads, and the frame being
    # received (its length prefix, then its payload so far; ``size``: the announced length,
    # -1 until the prefix is complete).
    frames: deque[bytes | mmap.mmap] = field(default_factory=deque)
    partial: bytearray = field(default_factory=bytearray)
    size: int = -1
    # A frame larger than one read, once its size is reserved: received straight into ``body``
    # (mapped memory: the system has it back, all of it, when the frame is handled).
    body: mmap.mmap | None = None
    filled: int = 0
    reserved: int = 0  # bytes of FRAME_BUDGET its large frames hold
    starving: bool = False  # its large frame waits for FRAME_BUDGET: not read meanwhile
    out: bytearray = field(default_factory=bytearray)
    authenticated: bool = False
    waiter: Waiter | None = None
    closing: bool = False
    events: int = selectors.EVENT_READ  # what the selector watches for it (0: unregistered)
    paused: bool = False  # its requests wait: its replies are over OUT_HIGH_WATER
    replica: bool = False  # a standby following this store: each change is sent to it
    handshake: Timer | None = None  # its deadline to authenticate
    handler: Callable[[int], None] | None = None  # the loop's handler of its events


@dataclass(eq=False, slots=True)
class Waiter:
    client: Client
    keys: tuple[str, ...]
    deadline: float
    version: int | None = None  # None: wait for the keys to exist; else watch for a change
    timer: Timer | None = None


def key_of(field: bytes) -> str:
    try:
        return field.decode()
    except UnicodeDecodeError:
        raise StoreProtocolError("keys must be UTF-8") from None


def seconds(millis: bytes) -> float:
    """A request's timeout field (decimal milliseconds) in seconds, clamped to a sane range."""
    return min(max(wire.to_int(millis), 0), _MAX_PARK_MS) / 1000


def _value(field: bytes) -> bytes:
    if len(field) > wire.MAX_VALUE:
        raise StoreError(f"value of {len(field)} bytes exceeds the limit of {wire.MAX_VALUE}")
    return field


def versioned_fields(value: bytes | None, version: int) -> list[bytes]:
    return [b"1" if value is not None else b"0", value or b"", wire.from_int(version)]


def frame(status: int, fields: list[bytes]) -> bytes:
    """A reply frame; an error frame if it cannot be one (e.g. a value too big to fit)."""
    try:
        return wire.encode(status, fields)
    except StoreProtocolError as exc:
        return wire.encode(wire.ERROR, [str(exc).encode()])


class Operations:
    """The store's state and its waiters. ``send(client, frame)`` queues a reply;
    ``schedule(deadline, action)`` runs ``action`` at ``deadline`` (the server's loop);
    ``changed(key)`` is told of each change first (the standbys', ``store.replication``)."""

    def __init__(
        self,
        send: Callable[[Client, bytes], None],
        schedule: Callable[[float, Callable[[], None]], Timer],
        now: Callable[[], float],
    ) -> None:
        self.state = KeyValueData()
        self.waiters: dict[str, dict[Waiter, None]] = {}
        self._send, self._schedule, self._now = send, schedule, now
        self.on_change: Callable[[str], None] | None = None

    def reply(self, client: Client, status: int, fields: list[bytes] | None = None) -> None:
        self._send(client, frame(status, fields or []))

    def get(self, client: Client, fields: list[bytes]) -> None:
        (key,) = fields
        self.reply(client, wire.OK, versioned_fields(*self.state.get(key_of(key))))

    def gets(self, client: Client, fields: list[bytes]) -> None:
        if len(fields) > wire.MAX_GETS:
            raise ValueError(f"at most {wire.MAX_GETS} keys a request")
        reply: list[bytes] = []
        for key in fields:
            reply += versioned_fields(*self.state.get(key_of(key)))
        self.reply(client, wire.OK, reply)

    def set(self, client: Client, fields: list[bytes]) -> None:
        key, value = key_of(fields[0]), _value(fields[1])
        self.reply(client, wire.OK, [wire.from_int(self.state.set(key, value))])
        self.changed(key)

    def cas(self, client: Client, fields: list[bytes]) -> None:
        key, expected, value = key_of(fields[0]), wire.to_int(fields[1]), _value(fields[2])
        succeeded, current = self.state.compare_set(key, expected, value)
        self.reply(client, wire.OK, [b"1" if succeeded else b"0", *versioned_fields(*current)])
        if succeeded:
            self.changed(key)

    def add(self, client: Client, fields: list[bytes]) -> None:
        key, amount = key_of(fields[0]), wire.to_int(fields[1])
        self.reply(client, wire.OK, [wire.from_int(self.state.add(key, amount))])
        self.changed(key)

    def delete(self, client: Client, fields: list[bytes]) -> None:
        key = key_of(fields[0])
        existed = self.state.delete(key)
        self.reply(client, wire.OK, [b"1" if existed else b"0"])
        if existed:
            self.changed(key)

    def wait(self, client: Client, fields: list[bytes]) -> None:
        # Duplicate keys would park the waiter twice on one key, and reply twice.
        timeout, keys = seconds(fields[0]), tuple(dict.fromkeys(key_of(k) for k in fields[1:]))
        if self.state.all_exist(keys):
            self.reply(client, wire.OK)
            return
        self.park(Waiter(client, keys, self._now() + timeout))

    def watch(self, client: Client, fields: list[bytes]) -> None:
        key, version, timeout = key_of(fields[0]), wire.to_int(fields[1]), seconds(fields[2])
        current = self.state.get(key)
        if current.version != version:
            self.reply(client, wire.OK, versioned_fields(*current))
            return
        self.park(Waiter(client, (key,), self._now() + timeout, version))

    def ping(self, client: Client, fields: list[bytes]) -> None:
        self.reply(client, wire.OK)

    # -- waiters ----------------------------------------------------------------------------

    def park(self, waiter: Waiter) -> None:
        waiter.client.waiter = waiter
        for key in waiter.keys:
            self.waiters.setdefault(key, {})[waiter] = None
        waiter.timer = self._schedule(waiter.deadline, lambda: self._expire(waiter))

    def unpark(self, waiter: Waiter) -> None:
        waiter.client.waiter = None
        if waiter.timer is not None:
            waiter.timer.cancel()
        for key in waiter.keys:
            parked = self.waiters.get(key)
            if parked is not None:
                parked.pop(waiter, None)
                if not parked:
                    del self.waiters[key]

    def changed(self, key: str) -> None:
        """Tell ``on_change``; wake the waiters on ``key`` (only those) that the change
        satisfies."""
        if self.on_change is not None:
            self.on_change(key)
        parked = self.waiters.get(key)
        if not parked:
            return
        current = self.state.get(key)
        watched: bytes | None = None  # one frame for every watcher of the key
        for waiter in list(parked):
            if waiter.version is None:
                if self.state.all_exist(waiter.keys):
                    self.unpark(waiter)
                    self.reply(waiter.client, wire.OK)
            elif current.version != waiter.version:
                self.unpark(waiter)
                if watched is None:
                    watched = frame(wire.OK, versioned_fields(*current))
                self._send(waiter.client, watched)

    def _expire(self, waiter: Waiter) -> None:
        """Time out ``waiter``: its deadline passed."""
        if waiter.client.waiter is not waiter:
            return
        self.unpark(waiter)
        if waiter.version is None:
            missing = [k.encode() for k in waiter.keys if not self.state.all_exist([k])]
            self.reply(waiter.client, wire.TIMEOUT, missing)
        else:
            current = self.state.get(waiter.keys[0])
            self.reply(waiter.client, wire.OK, versioned_fields(*current))

    def answer_all(self, status: int) -> None:
        """Answer every waiting request ``status`` (a fenced store: ``FENCED``)."""
        for parked in list(self.waiters.values()):
            for waiter in list(parked):
                self.unpark(waiter)
                self.reply(waiter.client, status)

    def handlers(self) -> dict[int, Callable[[Client, list[bytes]], None]]:
        """The operations by their code on the wire."""
        return {
            wire.GET: self.get,
            wire.SET: self.set,
            wire.CAS: self.cas,
            wire.ADD: self.add,
            wire.DELETE: self.delete,
            wire.WAIT: self.wait,
            wire.WATCH: self.watch,
            wire.PING: self.ping,
            wire.GETS: self.gets,
        }
