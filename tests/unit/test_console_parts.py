"""The pure parts of the console and the agent-worker channel: carriage returns, the node bar,
the run summary, and the shared-memory slots."""

from __future__ import annotations

import io

import pytest

from relaunch.core import channel
from relaunch.core.run.summary import RankEnd, RunSummary, format_summary
from relaunch.core.workers.progress import NodeProgress, Progress, read_progress
from relaunch.core.workers.streams import Std
from relaunch.procs.console import Console
from relaunch.runtime import ManualClock


def test_the_node_bar_follows_the_slowest_rank_with_rate_and_eta() -> None:
    node = NodeProgress(started_at=100.0)
    assert node.line(100.0) is None
    node.update({0: Progress(10, 100, 0, "train", 1), 1: None}, now=101.0)
    node.update({0: Progress(30, 100, 0, "train", 2), 1: Progress(20, 100, 0, "", 1)}, 103.0)
    line = node.line(103.0)
    assert line is not None
    assert line.startswith(" 20%|████") and "20/100" in line and "local rank 1" in line
    assert "5 step/s" in line and "00:03<00:16" in line
    node.update({0: Progress(7, None, 0, "", 3)}, 104.0)
    assert "step 7" in (node.line(104.0) or "")


def test_the_summary_says_how_each_rank_ended_and_why_it_restarted() -> None:
    text = format_summary(
        RunSummary(
            "succeeded",
            75.0,
            [RankEnd(1, 1, 0, 70.2), RankEnd(0, 0, -15, 3.0, "stopped by relaunch")],
            ["rank 1 killed by SIGKILL (signal 9): expiry timer 'step' expired"],
            "/logs/run",
        )
    )
    assert text.splitlines() == [
        "run summary: succeeded in 1m15s after 1 restart",
        "  rank 0 (local 0): killed by SIGTERM (signal 15) (stopped by relaunch) after 3.0s",
        "  rank 1 (local 1): exited with code 0 after 1m10s",
        "  restart 1: rank 1 killed by SIGKILL (signal 9): expiry timer 'step' expired",
        "  logs: /logs/run",
    ]


def test_a_slot_round_trips_and_a_torn_write_is_not_read() -> None:
    buffer = bytearray(channel.size(2))
    assert read_progress(buffer, 0) is None
    offset = channel.slot_offset(1)
    channel.FIELDS.pack_into(buffer, offset + 8, 5, -1, 12.5)
    buffer[offset + channel.DESC_OFFSET : offset + channel.DESC_END] = channel.encode_desc(
        "é" * 100
    )
    channel.SEQ.pack_into(buffer, offset, 3)  # odd: a write in progress
    assert read_progress(buffer, 1) is None
    channel.SEQ.pack_into(buffer, offset, 4)
    progress = read_progress(buffer, 1)
    assert progress == Progress(5, None, 12.5, "é" * 44, 2)


class FakeTerminal(io.TextIOWrapper):
    def __init__(self, tty: bool) -> None:
        super().__init__(io.BytesIO(), encoding="utf-8")
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty

    def text(self) -> bytes:
        self.flush()
        return self.buffer.getvalue()  # type: ignore[attr-defined]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(monotonic=1000.0)


def test_off_a_terminal_bars_are_throttled_and_end_printed(clock: ManualClock) -> None:
    out, err = FakeTerminal(False), FakeTerminal(False)
    console = Console(out, err, clock=clock)
    assert not console.live
    for percent in range(0, 100, 10):  # ten refreshes within one second
        console.set_bar("r0", b"[w0]:%d%%" % percent)
        console.tick()
        clock.advance(0.05)
    clock.advance(1.0)
    console.tick()
    console.set_bar("r0", b"[w0]:99%")
    console.end_bar("r0", print_last=True)
    assert err.text().splitlines() == [b"[w0]:0%", b"[w0]:90%", b"[w0]:99%"]
    assert console.next_tick() is None


def test_on_a_terminal_bars_live_below_the_scrolling_lines(
    clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    out, err = FakeTerminal(False), FakeTerminal(True)
    console = Console(out, err, clock=clock)
    assert console.live and console.prefix(b"[w1]:", 1, err=True) == b"\033[33m[w1]:\033[0m"
    console.set_bar("a", b"[w0]: 10%")
    console.set_bar("b", b"[w1]: 20%")
    console.tick()
    clock.advance(0.2)
    console.write(b"", b"[w0]:a log line\n")
    assert err.text().endswith(
        b"[w0]: 10%\n[w1]: 20%"  # drawn
        + b"\r\033[2K\033[1A\033[2K"  # erased: two rows
        + b"[w0]:a log line\n[w0]: 10%\n[w1]: 20%"  # the line above, the area redrawn
    )
    clock.advance(0.01)  # lines within a tenth of a second of the last drawing: no redraw yet
    console.write(b"", b"[w0]:another\n")
    assert err.text().endswith(b"\r\033[2K\033[1A\033[2K[w0]:another\n")
    assert console.next_tick() == pytest.approx(0.09)
    clock.advance(0.09)
    console.tick()
    assert err.text().endswith(b"[w0]:another\n[w0]: 10%\n[w1]: 20%")
    console.set_bar("a", b"   ")  # wiped (leave=False): gone, not printed, on a terminal
    assert not err.text().endswith(b"[w0]: 10%\n")
    monkeypatch.setenv("NO_COLOR", "1")
    assert Console(out, err).prefix(b"[w1]:", 1, err=True) == b"[w1]:"


def test_a_live_area_of_several_rows_per_bar_fits_the_screen(
    clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("LINES", "4")
    out, err = FakeTerminal(False), FakeTerminal(True)
    console = Console(out, err, clock=clock)
    assert console.terminals() == Std.ERR
    assert console.terminal_size(err=True, prefix_width=5) == (34, 4), "40 less prefix and one"
    assert console.terminal_size(err=False, prefix_width=5) is None, "stdout is no terminal"
    console.set_bar("a", b"[w0]:Epoch 1\n[w0]:loss 0.5")
    console.set_bar("b", b"[w1]:Epoch 1\n[w1]:loss 0.6")
    console.tick()
    # Four rows on a screen of four: the top one is left out, so that all can be erased again.
    assert err.text() == b"[w0]:loss 0.5\n[w1]:Epoch 1\n[w1]:loss 0.6"
    clock.advance(0.2)
    console.write(b"", b"[w0]:saved\n")
    assert err.text().endswith(
        b"\r\033[2K\033[1A\033[2K\033[1A\033[2K"  # three rows erased
        + b"[w0]:saved\n[w0]:loss 0.5\n[w1]:Epoch 1\n[w1]:loss 0.6"
    )


def test_bars_of_a_stream_that_is_no_terminal_are_printed_not_drawn(
    clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``relaunch train.py | tee log``: stderr is the terminal, stdout a pipe. A bar on stdout
    goes to the pipe, throttled; the terminal's live area shows only stderr's bars."""
    monkeypatch.setenv("TERM", "xterm")
    out, err = FakeTerminal(False), FakeTerminal(True)
    console = Console(out, err, clock=clock)
    assert console.live and console.terminals() == Std.ERR
    for percent in range(0, 100, 10):  # ten refreshes within one second
        console.set_bar("o", b"%d%%" % percent, err=False)
        console.tick()
        clock.advance(0.05)
    console.set_bar("e", b"[w0]: on the terminal")
    clock.advance(1.0)
    assert console.next_tick() == 0.0
    console.tick()
    console.end_bar("o", print_last=True)
    assert out.text().splitlines() == [b"0%", b"90%"], "throttled, then the final state"
    assert err.text() == b"[w0]: on the terminal", "only stderr's bar is drawn"


def test_relaunch_copies_a_file_or_pipe_stream_of_several_workers_or_under_hang_detection() -> None:
    from relaunch.core.output.console_plan import agent_tee, console_is_relaunchs, relayed

    # No flags, one worker: every stream is the worker's to inherit, bytes as they are.
    assert relayed(Std.NONE, Std.NONE, 1, terminals=Std.NONE) == {0: Std.NONE}
    assert not console_is_relaunchs(Std.NONE, Std.NONE, 1)
    # Several: a file or pipe stream is copied byte for byte, whole lines at a time, so ranks
    # never mix within a line; a terminal stream stays the worker's (prompts, breakpoint()).
    assert relayed(Std.NONE, Std.NONE, 2, terminals=Std.NONE) == {0: Std.ALL, 1: Std.ALL}
    assert relayed(Std.NONE, Std.NONE, 2, terminals=Std.ERR) == {0: Std.OUT, 1: Std.OUT}
    assert not console_is_relaunchs(Std.NONE, Std.NONE, 2, relay=Std.ALL)
    # Hang detection: a terminal stream is tee'd (prefixed, bars collapsed: not data), a file
    # or pipe stream relayed byte for byte; a redirected one stays redirected.
    tee = agent_tee(Std.NONE, {0: Std.ERR, 1: Std.NONE}, 2, True, terminals=Std.ERR)
    assert tee == {0: Std.NONE, 1: Std.ERR}
    assert relayed({0: Std.ERR, 1: Std.NONE}, tee, 2, Std.ERR, True) == {0: Std.OUT, 1: Std.OUT}
    # relaunch's bars go to stderr: it may draw them above a relayed stdout, never a stderr.
    assert console_is_relaunchs(Std.NONE, Std.ERR, 1, relay=Std.OUT)
    assert not console_is_relaunchs(Std.NONE, Std.OUT, 1, relay=Std.ERR)
