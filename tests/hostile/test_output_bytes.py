"""What a worker writes reaches a file or a pipe exactly as written (issue 24, item 1).

The worker writes 4 MiB of random bytes to stdout and 1,000 records ending in a carriage return
(no newline) to stderr; every byte must arrive, compared by sha256: straight through the
launcher's stdout and stderr with no flags (a file, a pipe), through the log files with
``--tee``/``-r``, and through relaunch's byte-for-byte relay with ``--hang-timeout``. Progress
bars are collapsed only where relaunch already rewrites lines with a rank prefix: the tee'd
console.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import subprocess
import sys
import textwrap

import pytest
from conftest import LeakCheck

pytestmark = pytest.mark.timeout(60)

SIZE = 4 << 20
SEED = 24
RECORDS = 1000

WORKER = textwrap.dedent(
    f"""
    import random, sys
    data = random.Random({SEED}).randbytes({SIZE})
    for start in range(0, len(data), 100_000):  # many writes, some of them partial on a pipe
        sys.stdout.buffer.write(data[start : start + 100_000])
    sys.stdout.buffer.flush()
    for i in range({RECORDS}):
        sys.stderr.write(f"rec {{i}}\\r")
    sys.stderr.flush()
    """
)

BINARY = hashlib.sha256(random.Random(SEED).randbytes(SIZE)).hexdigest()
RECORDS_TEXT = "".join(f"rec {i}\r" for i in range(RECORDS)).encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def launch(
    leaks: LeakCheck, tmp_path, *flags: str, stdout: int | None = None
) -> subprocess.CompletedProcess[bytes]:
    job = tmp_path / "gen.py"
    job.write_text(WORKER)
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "relaunch", "--log-dir", str(logs), *flags, str(job)]
    return subprocess.run(
        argv,
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE,
        env=leaks.process_env(),
        timeout=50,
    )


def log_of(tmp_path, name: str) -> bytes:
    (path,) = glob.glob(f"{tmp_path}/logs/*/attempt_0/0/{name}")
    with open(path, "rb") as file:
        return file.read()


def test_no_flags_to_a_file_every_byte_arrives(tmp_path, leaks: LeakCheck) -> None:
    with open(tmp_path / "out.bin", "wb") as out:
        done = launch(leaks, tmp_path, stdout=out.fileno())
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha((tmp_path / "out.bin").read_bytes()) == BINARY
    assert done.stderr.startswith(RECORDS_TEXT), "the records, each one, as written"


def test_no_flags_to_a_pipe_every_byte_arrives(tmp_path, leaks: LeakCheck) -> None:
    done = launch(leaks, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha(done.stdout) == BINARY
    assert done.stderr.startswith(RECORDS_TEXT)


def test_hang_detection_relays_every_byte_unprefixed(tmp_path, leaks: LeakCheck) -> None:
    done = launch(leaks, tmp_path, "--hang-timeout", "30")
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha(done.stdout) == BINARY, "relayed byte for byte: no prefix, nothing collapsed"
    assert done.stderr.startswith(RECORDS_TEXT)
    assert sha(log_of(tmp_path, "stdout.log")) == BINARY, "and logged for signs of life"


@pytest.mark.parametrize("flag", ["--tee", "--redirects"])
def test_log_files_get_every_byte(tmp_path, leaks: LeakCheck, flag: str) -> None:
    with open(tmp_path / "console.out", "wb") as out:
        done = launch(leaks, tmp_path, flag, "3", stdout=out.fileno())
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha(log_of(tmp_path, "stdout.log")) == BINARY
    assert log_of(tmp_path, "stderr.log") == RECORDS_TEXT
    if flag == "--redirects":
        assert (tmp_path / "console.out").read_bytes() == b""
        assert not done.stderr.startswith(b"rec")
    else:
        # The tee'd console is rewritten (a prefix per line): the bar of 1,000 refreshes is
        # collapsed to its last state there, and only there.
        shown = [line for line in done.stderr.split(b"\n") if line.startswith(b"[default0]:rec")]
        assert shown == [b"[default0]:rec 999"], shown[:5]
        assert b"\r" not in done.stderr


def test_the_console_writer_waits_on_a_full_non_blocking_pipe() -> None:
    """A console that is a non-blocking pipe (shared with a program that set O_NONBLOCK) fills
    up: the writer waits for room rather than dropping what did not fit."""
    import io
    import threading

    from relaunch.procs.console_writer import ConsoleWriter

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    received = bytearray()

    def drain() -> None:
        while chunk := os.read(read_fd, 4096):
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    dst = io.TextIOWrapper(io.BufferedWriter(io.FileIO(write_fd, "w")))
    data = random.Random(SEED).randbytes(1 << 20)  # 16 times what a pipe holds
    try:
        ConsoleWriter(dst).write_raw(data)
    finally:
        dst.close()
        reader.join(timeout=10)
        os.close(read_fd)
    assert sha(bytes(received)) == sha(data)
