"""What the console's live area shows (core.live_area): rows in order, cut to the terminal."""

from __future__ import annotations

import pytest

from relaunch.core.output.live_area import SOURCE_KEY, area_rows, coloured, erase, fit


def test_ranks_come_in_numeric_order_and_the_agents_bars_below_them() -> None:
    bars = {SOURCE_KEY + "node": b"node", "[w10]:": b"ten", "[w2]:": b"two\nmore", "[w1]:": b"one"}
    assert area_rows(bars, 80, None) == [b"one", b"two", b"more", b"ten", b"node"]
    assert area_rows(bars, 80, 3) == [b"ten", b"node"], "the lowest rows, one row to spare"


@pytest.mark.parametrize(
    ("line", "columns", "shown"),
    [
        (b"short", 10, b"short"),
        (b"exactly10!", 10, b"exactly10"),
        (b"\033[33mcoloured\033[0m", 9, b"\033[33mcoloured\033[0m"),
        (b"\033[33mcoloured\033[0m", 8, b"coloure"),
        (b"anything", 0, b"a"),
    ],
)
def test_a_row_never_wraps(line: bytes, columns: int, shown: bytes) -> None:
    assert fit(line, columns) == shown


def test_erasing_and_colouring() -> None:
    assert erase(0) == b""
    assert erase(3) == b"\r\033[2K" + b"\033[1A\033[2K" * 2
    assert coloured(b"[w1]:", 13) == b"\033[33m[w1]:\033[0m", "13 wraps round to yellow"
