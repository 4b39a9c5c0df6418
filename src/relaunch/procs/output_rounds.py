"""The monitor's copy of the tee'd output to the consoles, in rounds: each stream is read as its
pipe fills (``pump``), then each round writes once per console, ranks never interleaved within
a line, and redraws the bars that changed (``flush``).
"""

from __future__ import annotations

import selectors

from relaunch.procs.console import Console
from relaunch.procs.rank_streams import TeeStream


class OutputRounds:
    """The streams with output not written yet, and the selector that watches their pipes."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        self._dirty: list[TeeStream] = []

    def pump(self, stream: TeeStream, until_empty: bool = False) -> None:
        """Read what ``stream`` holds (all of it: ``until_empty``); stop watching it at its end."""
        if not stream.open:
            return
        at_end = stream.pump(until_empty)
        if stream.pending or stream.bar_changed:
            self._dirty.append(stream)
        if at_end:
            self._selector.unregister(stream.read_fd)
            stream.finish()

    def flush(self) -> bool:
        """Write this round's lines: one write per console, ranks never interleaved mid-line;
        then tell the console which bars changed. Returns whether there was anything."""
        if not self._dirty:
            return False
        by_console: dict[Console, tuple[list[bytes], list[bytes]]] = {}
        bars = []
        for stream in self._dirty:
            if stream.bar_changed:
                stream.bar_changed = False
                if stream.bar is None:  # its line was completed: the line shows the last state
                    stream.console.end_bar(stream.key, print_last=False)
                else:
                    bars.append(stream)
            if stream.pending:
                out, err = by_console.setdefault(stream.console, ([], []))
                (err if stream.err else out).append(stream.take_pending())
        self._dirty.clear()
        for console, (out, err) in by_console.items():
            console.write(b"".join(out), b"".join(err))
        for stream in bars:
            assert stream.bar is not None
            if not stream.bar:  # wiped: its last state first, for a log that keeps it
                stream.console.set_bar(
                    stream.key, stream.shown_bar(stream.framer.last_bar), stream.err
                )
            stream.console.set_bar(stream.key, stream.shown_bar(stream.bar), stream.err)
        return True
