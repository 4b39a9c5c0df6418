"""A worker's stream read as a terminal shows it: lines, bars and live displays, colours."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relaunch.core.output.screen import ScreenFramer


def feed_all(chunks: list[bytes]) -> tuple[bytes, bytes | None]:
    framer = ScreenFramer()
    lines, bar = b"", None
    for chunk in chunks:
        more, bar = framer.feed(chunk)
        lines += more
    return lines + framer.flush(), bar


def test_carriage_return_refreshes_become_the_bar_not_lines() -> None:
    framer = ScreenFramer()
    assert framer.feed(b"log line\n\r 10%|#") == (b"log line\n", b" 10%|#")
    assert framer.feed(b"#|\r 20%|##|") == (b"", b" 20%|##|")
    assert framer.feed(b"\r") == (b"", b" 20%|##|"), "a bare return leaves the bar on screen"
    assert framer.feed(b"100%|###|\n") == (b"100%|###|\n", None), "the newline makes it a line"
    assert framer.feed(b"\r 99%\r100%\r        \r") == (b"", b""), "wiped (tqdm's leave=False)"
    assert framer.last_bar == b"100%", "the state before the wipe, for a log that keeps it"
    assert framer.feed(b"tail") == (b"", b"tail") and framer.flush() == b"tail\n"


def test_a_line_not_yet_ended_is_held_and_a_bar_left_unfinished_is_flushed() -> None:
    framer = ScreenFramer()
    assert framer.feed(b"Loading") == (b"", None)
    assert framer.feed(b" done\n") == (b"Loading done\n", None)
    framer.feed(b"\r 10%\r 55%")
    assert framer.flush() == b" 55%\n"


def test_a_shorter_refresh_leaves_what_a_terminal_leaves() -> None:
    assert feed_all([b"Loading....\rDone\n"])[0] == b"Doneing....\n"
    assert feed_all([b"Loading....\r\x1b[KDone\n"])[0] == b"Done\n"


def test_erase_codes_never_reach_the_console_and_colours_are_kept() -> None:
    lines = feed_all([b"\r\x1b[2K\x1b[1mbold\x1b[0m and \x1b[32mgreen\x1b[0m\n"])[0]
    assert lines == b"\x1b[1mbold\x1b[0m and \x1b[32mgreen\x1b[0m\n"
    framer = ScreenFramer()
    assert framer.feed(b"\x1b[3") == (b"", None), "a sequence cut between two reads waits"
    assert framer.feed(b"1mred\n") == (b"\x1b[31mred\x1b[0m\n", None)
    assert framer.feed(b"still red\x1b[0m\n")[0] == b"\x1b[31mstill red\x1b[0m\n"


def test_rich_live_display_stays_live_while_log_lines_scroll_above_it() -> None:
    """Rich's live display: erase the area (return, erase, up, erase), print the log lines,
    then the area again, with the cursor left at the end of its last row."""
    framer = ScreenFramer()
    up_and_erase = b"\r\x1b[2K\x1b[1A\x1b[2K"
    framer.feed(b"\x1b[?25lEpoch 0 1/10\nloss 0.9")
    lines, bar = framer.feed(up_and_erase + b"Epoch 0 2/10\nloss 0.8")
    assert bar == b"Epoch 0 2/10\nloss 0.8", "both rows are live"
    lines, bar = framer.feed(up_and_erase + b"checkpoint saved\nEpoch 0 3/10\nloss 0.7")
    assert lines == b"checkpoint saved\n" and bar == b"Epoch 0 3/10\nloss 0.7"
    lines, bar = framer.feed(up_and_erase + b"Epoch 0 10/10\nloss 0.1\x1b[?25h\n")
    assert (lines, bar) == (b"Epoch 0 10/10\n", b"loss 0.1"), "within reach of the cursor"
    assert framer.feed(b"done\n") == (b"loss 0.1\ndone\n", None)


def test_nested_tqdm_bars_are_two_live_rows() -> None:
    framer = ScreenFramer()
    framer.feed(b"\repoch  0%|\n\rbatch  0%|\x1b[A")
    lines, bar = framer.feed(b"\repoch 50%|\n\rbatch 90%|\x1b[A")
    assert (lines, bar) == (b"", b"epoch 50%|\nbatch 90%|")


def test_undecodable_bytes_and_wide_characters_pass_through() -> None:
    assert feed_all([b"bad \xff\xfe", b"\r\x1b[Kbad \xff\n"])[0] == b"bad \xff\n"
    assert feed_all(["\r\x1b[K漢字 ok\n".encode()])[0] == "漢字 ok\n".encode()


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_plain_output_passes_untouched_whatever_the_chunking(chunks: list[bytes]) -> None:
    data = b"".join(chunks).translate(None, b"\x1b\r\b")
    plain = [data[i : i + 7] for i in range(0, len(data), 7)]
    lines, bar = feed_all(plain)
    assert bar is None
    cut = data.rfind(b"\n") + 1
    assert lines[:cut] == data[:cut], "every complete line, byte for byte"


TOKENS = [b"ab", b"xyz ", b"\n", b"\r", b"\x1b[2K", b"\x1b[K", b"\x1b[31m", b"\x1b[0m", b"\b"]
TOKENS += ["é€".encode(), b"\xff", b"\t", b"\x1b[3C", b"\x1b[5G"]


@pytest.mark.parametrize("seed", range(3))
@given(st.lists(st.sampled_from(TOKENS), max_size=40), st.lists(st.integers(1, 9), max_size=20))
def test_lines_do_not_depend_on_how_reads_cut_the_stream(
    seed: int, tokens: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(tokens)
    chunks, at = [], 0
    for size in cuts:
        chunks.append(data[at : at + size + seed])
        at += size + seed
    chunks.append(data[at:])
    assert feed_all(chunks)[0] == feed_all([data])[0]
