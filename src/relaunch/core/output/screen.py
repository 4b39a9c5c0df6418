"""A worker's console stream read as a terminal would show it: finished lines, and the rows a
program is still redrawing (progress bars, Rich's live displays).

``ScreenFramer`` interprets what bars use (carriage return, backspace, cursor up and down,
column moves, erase in line and display, saved cursor, colours) on an unbounded screen. Plain
rows are lines as soon as the cursor leaves them. Rows the program may come back to (within the
farthest it ever moved the cursor up, or redrawn ones) stay live: the console shows them at the
bottom, redrawn in place, until the cursor moves on. Colours are kept; anything else a
full-screen program would send (absolute rows, scroll regions, modes, titles) is dropped.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from collections import deque
from dataclasses import dataclass, field

from relaunch.core.output.lines import MAX_PARTIAL_LINE

#: The farthest above the cursor a program may redraw (taller live displays are cut).
MAX_REACH = 32

_CONTROL = re.compile(
    r"\x1b\[(?P<csi>[0-?]*)[ -/]*(?P<final>[@-~])"  # cursor, erase, colours
    r"|(?P<osc>\x1b\][^\x07\x1b]*(?:\x07|\x1b\\))"  # titles, hyperlinks: dropped
    r"|(?P<partial>\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?)?\Z)"  # completed by the next chunk
    r"|\x1b(?P<pair>[^\[\]])"  # two-character escapes: saved cursor, index
    r"|(?P<control>[\x00-\x08\x0a-\x1f\x7f])"  # control characters (tab is text)
)
_RESET = "\x1b[0m"


def _has_controls(data: bytes) -> bool:
    """Whether ``data`` is more than plain lines: escapes, carriage returns, backspaces. Three
    byte searches (memchr) rather than a regular expression: 75 times faster on a tee'd flood."""
    return b"\x1b" in data or b"\r" in data or b"\b" in data


@dataclass
class _Row:
    cells: list[str] = field(default_factory=list)
    styles: list[str] = field(default_factory=list)
    #: Whether the program ever came back to it (carriage return, cursor move, erase): a bar.
    drawn: bool = False

    def render(self) -> str:
        cells, styles = self.cells, self.styles
        if self.drawn:  # a bar's padding is not part of the line
            end = len(cells)
            while end and cells[end - 1] == " " and not styles[end - 1]:
                end -= 1
            cells, styles = cells[:end], styles[:end]
        parts: list[str] = []
        current = ""
        for cell, style in zip(cells, styles, strict=True):
            if style != current:
                parts.append(_RESET + style if current else style)
                current = style
            parts.append(cell)
        if current:
            parts.append(_RESET)
        return "".join(parts)

    def is_blank(self) -> bool:
        return not "".join(self.cells).strip()


def _cells(text: str) -> list[str]:
    """``text`` as terminal cells: a wide character takes two (the second empty), a combining
    one joins the cell before it."""
    if text.isascii():
        return list(text)
    cells: list[str] = []
    for char in text:
        if unicodedata.combining(char) and cells:
            cells[-1] += char
        elif unicodedata.east_asian_width(char) in "WF":
            cells += [char, ""]
        else:
            cells.append(char)
    return cells


class ScreenFramer:
    """Turns chunks of a stream into finished lines and the live rows still being redrawn.

    ``feed`` returns the lines finished so far (each ending in ``\\n``, colours kept, bytes that
    are not UTF-8 passed through) and the live rows joined by ``\\n``: None when no row is being
    redrawn (plain output, or a line not yet ended), ``b""`` once the bar was wiped. ``flush``
    returns everything left, as lines, at the end of the stream.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self._rows = [_Row()]
        self._row = 0
        self._col = 0
        self._style = ""
        self._saved = (0, 0)
        self._escape = ""
        self._reach = 0
        #: The raw bytes of a plain line not yet ended (plain text skips the screen).
        self._tail = b""
        #: Rows already given out as lines that the cursor may still go back up to.
        self._given: deque[_Row] = deque(maxlen=MAX_REACH)
        #: The last live rows with something on them, wiped or not: what a log should keep.
        self.last_bar = b""

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        if self._is_clean() and not _has_controls(data):
            buffer = self._tail + data if self._tail else data
            cut = buffer.rfind(b"\n") + 1
            self._tail = buffer[cut:]
            if len(self._tail) >= MAX_PARTIAL_LINE:
                buffer, cut, self._tail = buffer + b"\n", len(buffer) + 1, b""
            self._given.clear()
            return buffer[:cut], None
        data, self._tail = self._tail + data, b""
        self._interpret(self._escape + self._decoder.decode(data))
        return self._take_lines(), self._live()

    def flush(self) -> bytes:
        """Everything not yet handed out, as lines (a bar's last state included)."""
        data, self._tail = self._tail, b""
        self._interpret(self._escape + self._decoder.decode(data, final=True))
        self._escape = ""
        rows = self._rows
        while rows and rows[-1].is_blank():
            rows.pop()
        out = "".join(row.render() + "\n" for row in rows)
        self._rows, self._row, self._col = [_Row()], 0, 0
        return out.encode("utf-8", "surrogateescape")

    # -- reading ---------------------------------------------------------------------------------

    def _is_clean(self) -> bool:
        """Whether plain text may pass untouched: nothing drawn or pending, no colour set."""
        row = self._rows[0]
        return (
            self._row == 0
            and self._col == 0
            and len(self._rows) == 1
            and not row.cells
            and not row.drawn
            and not self._style
            and not self._escape
            and not self._decoder.getstate()[0]
        )

    def _interpret(self, text: str) -> None:
        self._escape = ""
        at = 0
        for match in _CONTROL.finditer(text):
            if match.start() > at:
                self._write(text[at : match.start()])
            at = match.end()
            kind = match.lastgroup
            if kind == "final":
                self._csi(match["csi"], match["final"])
            elif kind == "control":
                self._control(match["control"])
            elif kind == "pair":
                self._escape_pair(match["pair"])
            elif kind == "partial":
                self._escape = match["partial"]
        if at < len(text):
            self._write(text[at:])

    def _control(self, char: str) -> None:
        if char == "\n":
            self._line_feed()
        elif char == "\r":
            row = self._current
            if row.drawn and not row.is_blank():  # a refresh: the state it replaces
                self.last_bar = row.render().encode("utf-8", "surrogateescape")
            self._col = 0
            row.drawn = True
        elif char == "\b":
            self._col = max(0, self._col - 1)
            self._current.drawn = True

    def _escape_pair(self, char: str) -> None:
        if char == "7":
            self._saved = (self._row, self._col)
        elif char == "8":
            self._restore()
        elif char == "M":
            self._up(1)
        elif char in "DE":
            self._down(1)
            if char == "E":
                self._col = 0

    def _csi(self, params: str, final: str) -> None:
        if final == "m":
            self._sgr(params)
            return
        if params.startswith(("?", ">", "<", "=")):
            return  # private modes: cursor shown or hidden, bracketed paste, ...
        numbers = [int(p) if p.isdigit() else 0 for p in params.split(";")] if params else []
        first = numbers[0] if numbers else 0
        count = max(1, first)
        if final == "A":
            self._up(count)
        elif final in "BE":
            self._down(count)
        elif final == "F":
            self._up(count)
        elif final == "C":
            self._col += count
        elif final == "D":
            self._col = max(0, self._col - count)
        elif final in "G`":
            self._col = count - 1
        elif final in "Hf":
            self._col = max(1, numbers[1] if len(numbers) > 1 else 1) - 1
        elif final == "K":
            self._erase_in_row(first)
        elif final == "J":
            self._erase_below(first)
        elif final == "s":
            self._saved = (self._row, self._col)
        elif final == "u":
            self._restore()
        else:
            return
        if final in "EF":
            self._col = 0
        self._current.drawn = True

    def _sgr(self, params: str) -> None:
        if params in ("", "0"):
            self._style = ""
        elif len(self._style) > 64:
            self._style = f"\x1b[{params}m"
        else:
            self._style += f"\x1b[{params}m"

    # -- the screen ------------------------------------------------------------------------------

    @property
    def _current(self) -> _Row:
        return self._rows[self._row]

    def _write(self, text: str) -> None:
        row = self._current
        cells = _cells(text)
        end = self._col + len(cells)
        if self._col > len(row.cells):
            gap = self._col - len(row.cells)
            row.cells += [" "] * gap
            row.styles += [""] * gap
        if self._col < len(row.cells):
            row.drawn = True
        row.cells[self._col : end] = cells
        row.styles[self._col : end] = [self._style] * len(cells)
        self._col = end
        if len(row.cells) >= MAX_PARTIAL_LINE:
            self._line_feed()

    def _line_feed(self) -> None:
        """A new line starts at column 0, as on a terminal that turns LF into CR LF."""
        self._row += 1
        self._col = 0
        if self._row == len(self._rows):
            self._rows.append(_Row())

    def _up(self, count: int) -> None:
        target = self._row - count
        if target < 0 and self._given:
            back = min(-target, len(self._given))
            restored = [self._given.pop() for _ in range(back)][::-1]
            self._rows[:0] = restored
            self._row += back
            self._saved = (self._saved[0] + back, self._saved[1])
            target += back
        self._reach = min(MAX_REACH, max(self._reach, self._row - max(0, target)))
        self._row = max(0, target)
        self._current.drawn = True

    def _down(self, count: int) -> None:
        self._row = min(len(self._rows) - 1, self._row + count)
        self._current.drawn = True

    def _restore(self) -> None:
        row, self._col = self._saved
        if row < self._row:
            self._up(self._row - row)
        else:
            self._down(row - self._row)

    def _erase_in_row(self, mode: int) -> None:
        row = self._current
        if mode == 0:
            del row.cells[self._col :], row.styles[self._col :]
        elif mode == 1:
            keep = min(self._col + 1, len(row.cells))
            row.cells[:keep] = [" "] * keep
            row.styles[:keep] = [""] * keep
        else:
            row.cells.clear()
            row.styles.clear()

    def _erase_below(self, mode: int) -> None:
        if mode == 1:
            for row in self._rows[: self._row]:
                row.cells.clear()
                row.styles.clear()
                row.drawn = True
            self._erase_in_row(1)
            return
        if mode == 0:
            self._erase_in_row(0)
            below = self._rows[self._row + 1 :]
        else:
            below = self._rows
        for row in below:
            row.cells.clear()
            row.styles.clear()
            row.drawn = True

    # -- what comes out --------------------------------------------------------------------------

    def _take_lines(self) -> bytes:
        """Hand out the rows above the cursor that the program will not come back to: those
        farther up than it ever went, and plain ones it never came back to."""
        done = 0
        for index, row in enumerate(self._rows[: self._row]):
            if index >= self._row - self._reach and row.drawn:
                break
            done += 1
        if not done:
            return b""
        finished, self._rows = self._rows[:done], self._rows[done:]
        self._row -= done
        self._saved = (max(0, self._saved[0] - done), self._saved[1])
        self._given.extend(finished)
        return "".join(row.render() + "\n" for row in finished).encode("utf-8", "surrogateescape")

    def _live(self) -> bytes | None:
        rows = self._rows
        if not any(row.drawn for row in rows):
            self.last_bar = b""
            return None
        shown = list(rows)
        while shown and shown[-1].is_blank():
            shown.pop()
        live = "\n".join(row.render() for row in shown).encode("utf-8", "surrogateescape")
        if live:
            self.last_bar = live
        return live
