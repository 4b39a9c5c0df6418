"""The launcher's console, shared by every rank: workers' lines, whole and as they came,
scrolling above a live area of progress bars on a terminal, or the bars printed now and then
elsewhere. When to draw is decided here; the bytes of the live area come from
``core.output.live_area``, and ``console_writer`` writes them (its names are re-exported here,
where other modules import them)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from typing import Protocol, TextIO

from relaunch.core.output.live_area import SOURCE_KEY, area_rows, coloured, erase
from relaunch.core.workers.streams import Std
from relaunch.procs.console_writer import ConsoleWriter, ProgbarEvents
from relaunch.procs.terminals import WorkerTerminals, on_resize, pty_size
from relaunch.runtime import SYSTEM_CLOCK, Clock

#: Non-terminal consoles print a bar's refresh at most this often (its final state always).
THROTTLE_SECONDS = 1.0
#: Terminals redraw the live area at most this often.
REDRAW_SECONDS = 0.1
#: How long bytes relayed as they are (``TeeStream(verbatim=True)``) that do not end a line wait
#: for its end before they are written anyway: a prompt shows within this time, and a line
#: written in two parts (its text, then its newline, as ``print`` does) is whole.
HOLD_SECONDS = 0.25

#: What produces bars besides the workers' streams (the agent's per-node bar): key -> line.
BarSource = Callable[[], dict[str, bytes]]


class HeldLine(Protocol):
    """A stream that holds the start of a line until its end comes (see ``Console.hold``)."""

    err: bool

    def take_held(self) -> bytes:
        """The bytes held, no longer held."""
        ...


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def terminals_of(stdout: TextIO, stderr: TextIO) -> Std:
    """Which of the launcher's streams ``stdout`` and ``stderr`` are a terminal."""
    out = Std.OUT if _is_terminal(stdout) else Std.NONE
    return Std(out | (Std.ERR if _is_terminal(stderr) else Std.NONE))


def colours_wanted(stream: TextIO) -> bool:
    """Colour on a terminal, unless ``NO_COLOR`` is set (https://no-color.org)."""
    return _is_terminal(stream) and not os.environ.get("NO_COLOR")


class _Bar:
    __slots__ = ("err", "live", "printed", "printed_at", "text")

    def __init__(self, text: bytes, err: bool, live: bool) -> None:
        self.text, self.err = text, err
        #: Drawn in the live area (its stream is the terminal), else printed now and then.
        self.live = live
        self.printed: bytes | None = None
        self.printed_at = -1e9


class Console:
    """The launcher's stdout and stderr, shared by every rank: whole lines, and progress bars.

    On a terminal (stderr a tty), the bars of the streams that are the terminal (stderr, and
    stdout when it is one too) live in an area at the bottom, redrawn in place (at most every
    ``REDRAW_SECONDS``) while log lines scroll above it. Elsewhere (a CI log, a pipe) a bar is
    printed as a line at most every ``THROTTLE_SECONDS``, and its final state always. Prefixes
    get a stable colour per rank on a terminal. Those periods are measured on ``clock``.
    """

    def __init__(
        self,
        stdout: TextIO,
        stderr: TextIO,
        progbar_events: ProgbarEvents | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._clock = clock
        self.out = ConsoleWriter(stdout, progbar_events)
        self.err = ConsoleWriter(stderr, progbar_events)
        # ice-learn's handshake means the program draws its own bar: relaunch draws none.
        self.live = progbar_events is None and _is_terminal(stderr)
        self._stdout_crosses = self.live and _is_terminal(stdout)
        self._colour = {False: colours_wanted(stdout), True: colours_wanted(stderr)}
        self._size = shutil.get_terminal_size((100, 24)) if self.live else None
        self._width = self._size.columns if self._size else 0
        self._bars: dict[str, _Bar] = {}
        self._sources: list[BarSource] = []
        self._wakers: list[Callable[[], None]] = []
        self._drawn_rows = 0
        self._dirty = False
        self._drawn_at = -1e9
        #: Bar sources are asked once a period: as often as the live area may be redrawn, or as
        #: a bar may be printed off a terminal.
        self._period = REDRAW_SECONDS if self.live else THROTTLE_SECONDS
        self._polled_at = -1e9
        self._lock = threading.RLock()
        #: The workers' pseudo-terminals, resized with the launcher's.
        self.worker_terminals = WorkerTerminals()
        self._resized = False
        #: Streams holding part of a line: since when, and the thread that writes their lines.
        self._held: dict[HeldLine, tuple[float, int]] = {}
        if self.live:
            on_resize(self.resized)

    def terminals(self) -> Std:
        """The launcher's streams that are a terminal."""
        return terminals_of(self.out.stream, self.err.stream)

    def terminal_size(self, err: bool, prefix_width: int) -> tuple[int, int] | None:
        """(columns, rows) of a pseudo-terminal for a worker stream shown on this console with a
        prefix ``prefix_width`` wide; None when it is not drawn on a terminal by relaunch."""
        if self._size is None or not (err or self._stdout_crosses):
            return None
        return pty_size(self._size, prefix_width)

    def resized(self) -> None:
        """The launcher's terminal changed size (SIGWINCH): the next ``tick`` follows it. Safe
        in a signal handler: it only wakes the threads that tick."""
        self._resized = True
        for wake in list(self._wakers):
            wake()

    def _follow_resize(self) -> None:
        self._resized = False
        try:
            size = os.get_terminal_size(self.err.stream.fileno())
        except (OSError, ValueError):
            return
        if size == self._size:
            return
        self._size, self._width = size, size.columns
        self._dirty = True
        self.worker_terminals.resize(size)

    # -- lines ----------------------------------------------------------------------------------

    def prefix(self, prefix: bytes, rank: int, err: bool) -> bytes:
        """``prefix``, coloured by ``rank`` when the stream it goes to wants colour."""
        return coloured(prefix, rank) if self._colour[err] else prefix

    def render(self, lines: bytes, prefix: bytes) -> bytes:
        return self.out.render(lines, prefix)

    def write(self, out: bytes, err: bytes) -> None:
        """Write rendered lines to stdout and stderr, above the live area.

        The area is drawn again at once only if its last drawing is older than
        ``REDRAW_SECONDS``; under a flood of lines it waits for ``tick``, so a terminal gets at
        most ten redraws a second whatever the rate of lines.
        """
        if not out and not err:
            return
        with self._lock:
            if not self.live or (not self._drawn_rows and not self._live_bars()):
                self.out.write(out)
                self.err.write(err)
                return
            erase = self._erase()
            self._dirty = True
            due = self._clock.monotonic() - self._drawn_at >= REDRAW_SECONDS
            draw = self._draw() if due else b""
            if out and self._stdout_crosses:
                self.err.write_raw(erase)
                self.out.write(out)
                self.err.write_raw(err + draw)
            else:
                self.out.write(out)
                self.err.write_raw(erase + err + draw)

    def hold(self, stream: HeldLine) -> None:
        """``stream`` holds the start of a line (its bytes before are written, or pending with
        the caller): the caller's ``tick`` writes it as it is ``HOLD_SECONDS`` after it was first
        held, unless ``unhold`` came first. Only the thread that holds it writes it, after the
        lines it wrote before: a stream's bytes stay in order whatever other threads tick."""
        with self._lock:
            if stream not in self._held:
                self._held[stream] = (self._clock.monotonic(), threading.get_ident())

    def unhold(self, stream: HeldLine) -> None:
        """``stream`` holds nothing now (its line ended, or it wrote what it held)."""
        with self._lock:
            self._held.pop(stream, None)

    def _write_held(self, now: float) -> None:
        me = threading.get_ident()
        due = [
            stream
            for stream, (since, owner) in self._held.items()
            if owner == me and now - since >= HOLD_SECONDS
        ]
        for stream in due:
            del self._held[stream]
            data = stream.take_held()
            self.write(b"" if stream.err else data, data if stream.err else b"")

    # -- bars -----------------------------------------------------------------------------------

    def set_bar(self, key: str, line: bytes, err: bool = True) -> None:
        """The bar ``key`` now shows ``line`` (prefix included); an empty line wipes it (off a
        terminal its last state is still printed: a log keeps the final state of every bar)."""
        with self._lock:
            bar = self._bars.get(key)
            if not line.strip():
                if bar is not None:
                    self._remove(key, print_last=not bar.live)
                return
            if bar is None:
                live = self.live and (err or self._stdout_crosses)
                bar = self._bars[key] = _Bar(line, err, live)
            elif bar.text == line:
                return
            bar.text = line
            self._dirty = self._dirty or bar.live

    def end_bar(self, key: str, print_last: bool) -> None:
        """The bar ``key`` is over: its line completed (``print_last=False``: the line says it
        all) or its stream ended with it."""
        with self._lock:
            if key in self._bars:
                self._remove(key, print_last)

    def unprinted(self, key: str, lines: bytes) -> bytes:
        """``lines`` (rendered, each ended) that bar ``key``'s row became, less their first
        where that is what the bar's last refresh printed off a terminal, still its state: a
        log has it already."""
        with self._lock:
            bar = self._bars.get(key)
            if bar is None or bar.live or bar.printed != bar.text:
                return lines
            printed = bar.text + b"\n"
            return lines[len(printed) :] if lines.startswith(printed) else lines

    def add_source(self, source: BarSource) -> None:
        """Ask ``source`` for bars at every tick (the threads that tick are woken to start)."""
        with self._lock:  # held while waking: a waker removed is never called afterwards
            self._sources.append(source)
            for wake in self._wakers:
                wake()

    def add_waker(self, wake: Callable[[], None]) -> None:
        """``wake()`` makes a thread that calls ``tick`` look at ``next_tick`` again."""
        with self._lock:
            self._wakers.append(wake)

    def remove_waker(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._wakers:
                self._wakers.remove(wake)

    def remove_source(self, source: BarSource) -> None:
        """Stop asking ``source``; the final state of its bars is printed."""
        with self._lock:
            if source not in self._sources:
                return
            for key, line in source().items():
                self.set_bar(SOURCE_KEY + key, line)
            self._sources.remove(source)
            for key in [k for k in self._bars if k.startswith(SOURCE_KEY)]:
                self._remove(key, print_last=True)

    def next_tick(self) -> float | None:
        """Seconds until ``tick`` has something to do, or None."""
        with self._lock:
            if self._resized:
                return 0.0
            now = self._clock.monotonic()
            waits = []
            if self._sources:
                waits.append(self._polled_at + self._period - now)
            if self.live and self._dirty:
                waits.append(self._drawn_at + REDRAW_SECONDS - now)
            waits += [
                bar.printed_at + THROTTLE_SECONDS - now
                for bar in self._bars.values()
                if not bar.live and bar.text != bar.printed
            ]
            me = threading.get_ident()
            waits += [
                since + HOLD_SECONDS - now for since, owner in self._held.values() if owner == me
            ]
            return max(0.0, min(waits)) if waits else None

    def tick(self) -> None:
        """Redraw (terminal) or print due refreshes (elsewhere); asks the bar sources; writes
        the partial lines this thread held for ``HOLD_SECONDS``. The caller has written the
        lines of its streams before (those bytes come first)."""
        with self._lock:
            if self._resized:
                self._follow_resize()
            now = self._clock.monotonic()
            if self._held:
                self._write_held(now)
            if self._sources and now - self._polled_at >= self._period:
                # Sources are asked at the display's rate, not at every wake-up of the monitor
                # (which, under a flood of output, wakes thousands of times a second).
                self._polled_at = now
                for source in self._sources:
                    for key, line in source().items():
                        self.set_bar(SOURCE_KEY + key, line)
            if self.live and self._dirty and now - self._drawn_at >= REDRAW_SECONDS:
                self.err.write_raw(self._erase() + self._draw())
            out: list[bytes] = []
            err: list[bytes] = []
            for bar in self._bars.values():
                if bar.live or bar.text == bar.printed:
                    continue
                if now - bar.printed_at >= THROTTLE_SECONDS:
                    (err if bar.err else out).append(bar.text + b"\n")
                    bar.printed, bar.printed_at = bar.text, now
            self.out.write(b"".join(out))
            self.err.write(b"".join(err))

    def _remove(self, key: str, print_last: bool) -> None:
        bar = self._bars.pop(key)
        last = bar.text + b"\n" if print_last and bar.text != bar.printed else b""
        if bar.live:
            self.err.write_raw(self._erase() + (last if bar.err else b"") + self._draw())
            if last and not bar.err:
                self.out.write(last)
        elif last:
            (self.err if bar.err else self.out).write(last)

    # -- the live area --------------------------------------------------------------------------

    def _live_bars(self) -> bool:
        return any(bar.live for bar in self._bars.values())

    def _erase(self) -> bytes:
        rows, self._drawn_rows = self._drawn_rows, 0
        return erase(rows)

    def _draw(self) -> bytes:
        self._dirty = False
        self._drawn_at = self._clock.monotonic()
        bars = {key: bar.text for key, bar in self._bars.items() if bar.live}
        rows = area_rows(bars, self._width, self._size.lines if self._size else None)
        self._drawn_rows = len(rows)
        return b"\n".join(rows)


_consoles: dict[tuple[int, int, int], Console] = {}
_consoles_guard = threading.Lock()


def console_for(
    stdout: TextIO, stderr: TextIO, progbar_events: ProgbarEvents | None = None
) -> Console:
    """The one ``Console`` of this stdout/stderr pair (there is one live area per terminal)."""
    key = (id(stdout), id(stderr), id(progbar_events))
    with _consoles_guard:
        console = _consoles.get(key)
        if console is None:
            console = _consoles[key] = Console(stdout, stderr, progbar_events)
        return console
