"""What the console's live area shows, as bytes: its rows in order, cut to the terminal, the
sequence that erases it, and a rank's coloured prefix.

Pure: ``procs/console.py`` decides when to draw and writes what these return.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: Prefix colours, by local rank: cyan, yellow, magenta, green, blue, red, then bright ones.
COLOURS = (36, 33, 35, 32, 34, 31, 96, 93, 95, 92, 94, 91)
#: Keys of the bars that come from the agent (the node bar) rather than a worker's stream.
SOURCE_KEY = "source:"

#: Compiled where first used (``re`` keeps them): only a console with a live area needs them.
_ANSI = r"\033\[[0-9;]*[A-Za-z]"
_DIGITS = r"(\d+)"


def coloured(prefix: bytes, rank: int) -> bytes:
    """``prefix`` in the colour of ``rank``, the colour reset after it."""
    return b"\033[%dm" % COLOURS[rank % len(COLOURS)] + prefix + b"\033[0m"


def erase(rows: int) -> bytes:
    """What erases a live area of ``rows`` rows, the cursor on its last row, leaving the cursor
    at the start of its first."""
    if not rows:
        return b""
    return b"\r\033[2K" + b"\033[1A\033[2K" * (rows - 1)


def area_rows(bars: Mapping[str, bytes], columns: int, lines: int | None) -> list[bytes]:
    """The rows of the live area showing ``bars`` (key -> text, rows split at newlines): ranks
    in numeric order, the agent's bars below them, each row cut to ``columns`` so that none
    wraps; on a screen of ``lines`` rows, the lowest that fit (rows above the screen's top
    could not be erased again)."""
    rows = [fit(row, columns) for key in sorted(bars, key=_order) for row in bars[key].split(b"\n")]
    if lines is not None and len(rows) >= lines:
        rows = rows[len(rows) - lines + 1 :]
    return rows


def fit(line: bytes, columns: int) -> bytes:
    """``line`` as it is when it is narrower than ``columns``, else its text cut (colours
    dropped) to ``columns - 1`` characters."""
    text = line.decode("utf-8", errors="replace")
    plain = re.sub(_ANSI, "", text)
    if len(plain) < columns:
        return line
    return plain[: max(1, columns - 1)].encode()


def _order(key: str) -> tuple[bool, list[str | int]]:
    plain = re.sub(_ANSI, "", key)
    parts: list[str | int] = [int(p) if p.isdigit() else p for p in re.split(_DIGITS, plain)]
    return key.startswith(SOURCE_KEY), parts
