"""Turning a byte stream into whole lines, for consoles that must never show half a line."""

from __future__ import annotations

#: A partial line longer than this is emitted as a line of its own rather than held forever.
MAX_PARTIAL_LINE = 1 << 20


class LineFramer:
    """Splits arbitrary chunks of bytes into complete lines, holding back a trailing partial line.

    ``feed`` returns the complete lines seen so far as one ``bytes`` (each ending in ``\\n``), so a
    chunk of many lines costs a constant number of operations; ``flush`` returns what is left,
    terminated with a newline, at the end of the stream.
    """

    def __init__(self, max_partial: int = MAX_PARTIAL_LINE) -> None:
        self._partial = b""
        self._max_partial = max_partial

    def feed(self, data: bytes) -> bytes:
        buffer = self._partial + data if self._partial else data
        cut = buffer.rfind(b"\n") + 1
        if cut == 0:
            if len(buffer) >= self._max_partial:
                self._partial = b""
                return buffer + b"\n"
            self._partial = buffer
            return b""
        self._partial = buffer[cut:]
        return buffer[:cut]

    def flush(self) -> bytes:
        rest, self._partial = self._partial, b""
        return rest + b"\n" if rest else b""


def prefix_lines(lines: bytes, prefix: bytes, progress_safe: bool = False) -> bytes:
    """Prefix every line of ``lines`` (complete lines, each ending in ``\\n``) with ``prefix``.

    With ``progress_safe`` each line is written as ``\\r{line}\\033[K\\n`` so that it overwrites a
    progress bar drawn on the current terminal line.
    """
    if not lines:
        return b""
    body = lines[:-1]
    if progress_safe:
        start, sep, end = b"\r" + prefix, b"\033[K\n\r" + prefix, b"\033[K\n"
    else:
        start, sep, end = prefix, b"\n" + prefix, b"\n"
    return start + body.replace(b"\n", sep) + end


def as_shown(lines: bytes) -> bytes:
    """Complete lines as a terminal leaves them: of ``a\\rb``, only what follows the last ``\\r``
    (a trailing ``\\r`` before the newline, as in ``\\r\\n``, is dropped)."""
    if b"\r" not in lines:
        return lines
    shown = []
    for line in lines.split(b"\n")[:-1]:
        line = line.rstrip(b"\r")
        shown.append(line[line.rfind(b"\r") + 1 :])
    return b"\n".join(shown) + b"\n"


class ConsoleFramer:
    """Like ``LineFramer``, for a console: carriage-return refreshes (progress bars) are not
    lines. ``feed`` returns the complete lines as shown, and the bar the stream is redrawing
    now: its text (``b""`` once it was wiped), or None when no bar is being drawn."""

    def __init__(self, max_partial: int = MAX_PARTIAL_LINE) -> None:
        self._partial = b""
        self._max_partial = max_partial
        #: The last bar state with something on it, wiped or not: what a log should keep.
        self.last_bar = b""

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        buffer = self._partial + data if self._partial else data
        cut = buffer.rfind(b"\n") + 1
        complete, rest = as_shown(buffer[:cut]), buffer[cut:]
        bar = None
        if b"\r" in rest:
            segments = rest.split(b"\r")
            drawn = [segment for segment in segments if segment.strip()]
            if drawn:
                self.last_bar = drawn[-1]
            if segments[-1]:
                bar, rest = segments[-1], b"\r" + segments[-1]
            else:  # the cursor was just sent back: what is on screen is the segment before
                bar = segments[-2] if len(segments) > 1 else b""
                rest = b"\r" + bar + b"\r"
            if not bar.strip():
                bar, rest = b"", b""  # wiped: the line is empty again
        if len(rest) >= self._max_partial:
            complete += as_shown(rest + b"\n")
            rest, bar = b"", None
        self._partial = rest
        return complete, bar

    def flush(self) -> bytes:
        """What is left at the end of the stream, as a line (a bar's last state included)."""
        rest, self._partial = self._partial, b""
        if not rest.strip(b"\r \t"):
            return b""
        return as_shown(rest + b"\n")
