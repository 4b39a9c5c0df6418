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
    return b"".join((start, body.replace(b"\n", sep), end))
