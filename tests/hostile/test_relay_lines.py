"""The byte-for-byte relay (``--hang-timeout``, a stream on a file or a pipe) keeps lines whole.

Each rank's bytes arrive exactly as written and in order, but the relay writes them to the shared
destination a line at a time: two ranks that write the text of a line and its newline in separate
``write()`` calls (as ``print`` does) never interleave within a line. A line not ended yet (a
prompt) is written as it is after a short hold, while the worker still runs; binary data and
``\\r`` records pass too (tests/hostile/test_output_bytes.py compares them by sha256).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest
from conftest import LeakCheck, wait_until

from relaunch.procs import rank_streams
from relaunch.procs.console import HOLD_SECONDS, Console
from relaunch.procs.rank_streams import TeeStream
from relaunch.runtime import ManualClock

pytestmark = pytest.mark.timeout(60)

LINES = 300

SPLIT_WRITES = textwrap.dedent(
    f"""
    import os, time
    rank = os.environ["LOCAL_RANK"]
    for i in range({LINES}):
        os.write(1, f"rank {{rank}} line {{i}} ".encode() + b"x" * 40)  # the text, then
        time.sleep(0.001)  # (a worker descheduled, or busy, between them)
        os.write(1, b"\\n")  # its newline: two writes, as print() makes them
    """
)


def expected_lines() -> Counter[bytes]:
    return Counter(
        f"rank {rank} line {i} ".encode() + b"x" * 40 for rank in (0, 1) for i in range(LINES)
    )


def argv(tmp_path, job: str, *flags: str) -> list[str]:
    path = tmp_path / "job.py"
    path.write_text(job)
    logs = str(tmp_path / "logs")
    return [sys.executable, "-m", "relaunch", "--log-dir", logs, *flags, str(path)]


def test_two_ranks_never_interleave_within_a_line(tmp_path, leaks: LeakCheck) -> None:
    done = subprocess.run(
        argv(tmp_path, SPLIT_WRITES, "--nproc-per-node", "2", "--hang-timeout", "30"),
        capture_output=True,
        env=leaks.process_env(),
        timeout=50,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.endswith(b"\n")
    lines = done.stdout[:-1].split(b"\n")
    mixed = [line for line in lines if line not in expected_lines()]
    assert not mixed, f"{len(mixed)} lines mixed within a line, e.g. {mixed[:3]}"
    assert Counter(lines) == expected_lines(), "every line once, none lost"
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(b"rank %d " % rank)]
        assert mine == [b"rank %d line %d " % (rank, i) + b"x" * 40 for i in range(LINES)]


PROMPT = textwrap.dedent(
    """
    import os, sys, time
    go = sys.argv[1]
    os.write(1, b"ready> ")  # a prompt: no newline
    deadline = time.monotonic() + 40
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.write(1, b"go\\n")
    """
)


def test_a_partial_line_is_written_within_a_second_while_the_worker_runs(
    tmp_path, leaks: LeakCheck
) -> None:
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [*argv(tmp_path, PROMPT, "--hang-timeout", "30"), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=leaks.process_env(),
    )
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        received = bytearray()

        def read() -> bytes:
            try:
                received.extend(os.read(proc.stdout.fileno(), 4096))  # type: ignore[union-attr]
            except BlockingIOError:
                pass
            return bytes(received)

        log = tmp_path / "logs"
        wait_until(lambda: list(log.glob("*/attempt_0/0/stdout.log")), 20, "the worker to start")
        (stdout_log,) = log.glob("*/attempt_0/0/stdout.log")
        wait_until(lambda: stdout_log.read_bytes() == b"ready> ", 20, "the prompt in the log")
        written = time.monotonic()
        wait_until(lambda: read() == b"ready> ", 5, "the prompt on the relayed stdout")
        assert time.monotonic() - written < 1.5, "held a short time only"
        assert proc.poll() is None, "while the worker waits at its prompt"
        go.touch()
        rest, err = proc.communicate(timeout=30)
        received += rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert bytes(received) == b"ready> go\n"


# -- the relay itself, on a manual clock ------------------------------------------------------


def relay(clock: ManualClock) -> tuple[TeeStream, io.BytesIO, int]:
    out = io.TextIOWrapper(io.BytesIO())  # no fileno: the console writes to .buffer
    console = Console(out, io.TextIOWrapper(io.BytesIO()), clock=clock)
    read_fd, write_fd = os.pipe()
    stream = TeeStream(read_fd, None, console, b"", verbatim=True)
    return stream, out.buffer, write_fd  # type: ignore[return-value]


def written(stream: TeeStream, out: io.BytesIO) -> bytes:
    stream.console.write(stream.take_pending(), b"")  # as the monitor does once per round
    return out.getvalue()


def test_the_relay_holds_a_partial_line_until_its_end_or_a_short_time() -> None:
    clock = ManualClock()
    stream, out, write_fd = relay(clock)
    try:
        os.write(write_fd, b"one\ntw")
        stream.pump()
        assert written(stream, out) == b"one\n", "the whole line; the rest is held"
        assert stream.console.next_tick() == pytest.approx(HOLD_SECONDS)
        os.write(write_fd, b"o\nthr")
        clock.advance(HOLD_SECONDS / 2)
        stream.pump()
        assert written(stream, out) == b"one\ntwo\n"
        clock.advance(HOLD_SECONDS / 2)
        stream.console.tick()
        assert out.getvalue() == b"one\ntwo\n", "held since its own start, not the line's"
        clock.advance(HOLD_SECONDS / 2)
        stream.console.tick()
        assert out.getvalue() == b"one\ntwo\nthr", "written as it is once held long enough"
        assert stream.console.next_tick() is None
        os.write(write_fd, b"ee")
        stream.pump()
        os.close(write_fd)
        write_fd = -1
        assert stream.pump(until_empty=True)
        stream.finish()
        assert out.getvalue() == b"one\ntwo\nthree", "the end of the stream writes the rest"
        assert stream.console.next_tick() is None
    finally:
        if write_fd >= 0:
            os.close(write_fd)


def test_the_relay_writes_a_long_partial_line_as_it_is() -> None:
    clock = ManualClock()
    stream, out, write_fd = relay(clock)
    try:
        record = b"\x00\xff\r" * 1000
        sent = b""
        while len(sent) <= rank_streams.HOLD_BYTES:
            os.write(write_fd, record)
            sent += record
            stream.pump()
        shown = written(stream, out)
        assert shown == sent, "binary data or \\r records, past the bound: passed on in order"
        assert stream.console.next_tick() is None
    finally:
        os.close(write_fd)
        stream.finish()
