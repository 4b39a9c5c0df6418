"""The console of a real run, through pipes (a CI log) and in a pseudo-terminal; graceful stop;
the run summary; rank filters and prefixes; progress in status events."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from collections.abc import Callable

import pytest
from conftest import LeakCheck

pytestmark = pytest.mark.timeout(90)

BARS = """
    import os, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    for i in range(1, 101):
        sys.stderr.write(f"\\rrank {rank} {i:3d}%|{'#' * (i // 10):10}|")
        sys.stderr.flush()
        if i % 25 == 0:
            print(f"rank {rank} reached {i}", flush=True)
        time.sleep(0.01)  # a bar refreshed 100 times a second
    sys.stderr.write("\\n")
"""

ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")


def write_job(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(leaks: LeakCheck, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaunch", *argv],
        capture_output=True,
        text=True,
        env=leaks.process_env(**env),
        timeout=60,
    )


def test_off_a_terminal_bars_are_throttled_and_every_final_state_printed(
    tmp_path, leaks: LeakCheck
) -> None:
    job = write_job(tmp_path, BARS)
    done = run(
        leaks, "--nproc-per-node", "8", "--tee", "3", "--log-dir", str(tmp_path / "logs"), job
    )
    assert done.returncode == 0, done.stderr
    for rank in range(8):
        bars = [line for line in done.stderr.splitlines() if f"]:rank {rank} " in line]
        assert 1 <= len(bars) <= 5, f"rank {rank}: {len(bars)} bar lines for 100 refreshes"
        assert bars[-1].endswith(f"rank {rank} 100%|##########|"), "the final state, always"
        for step in (25, 50, 75, 100):
            assert f"[default{rank}]:rank {rank} reached {step}" in done.stdout
    [log] = list((tmp_path / "logs").glob("*/attempt_0/3/stderr.log"))
    assert log.read_bytes().count(b"\r") == 100, "the log file keeps every byte"


def run_in_terminal(argv: list[str], env: dict[str, str], timeout: float = 60) -> bytes:
    """Run ``argv`` on a new pseudo-terminal; everything it wrote to it."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once
        os.execvpe(argv[0], argv, env)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
            if not ready:
                break
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not data:
                break
            output.extend(data)
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, output.decode(errors="replace")
    return bytes(output)


def test_on_a_terminal_bars_are_redrawn_in_place_below_the_log(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(tmp_path, BARS)
    env = leaks.process_env(TERM="xterm", COLUMNS="120")
    env.pop("NO_COLOR", None)
    screen = run_in_terminal(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", "--tee", "3", job], env
    )
    assert b"\r\x1b[2K\x1b[1A\x1b[2K" in screen, "the live area (two bars) is erased in place"
    assert b"\x1b[36m[default0]:\x1b[0m" in screen and b"\x1b[33m[default1]:\x1b[0m" in screen
    plain = ANSI.sub(b"", screen)
    for rank in (0, 1):
        for step in (25, 50, 75, 100):  # every log line once, whole, never inside a bar
            assert plain.count(f"[default{rank}]:rank {rank} reached {step}\r\n".encode()) == 1
        draws = screen.count(f"rank {rank} ".encode()) - 4
        assert draws < 60, f"rank {rank}: {draws} redraws for 100 refreshes (10 a second at most)"
        assert f"[default{rank}]:rank {rank} 100%|##########|\r\n".encode() in plain


def test_no_color_turns_colours_off(tmp_path, leaks: LeakCheck) -> None:
    """Relaunch's prefixes, and the workers (a terminal of their own, NO_COLOR inherited)."""
    job = write_job(
        tmp_path,
        """
        try:
            from rich import print as rich_print  # colours on a terminal, unless NO_COLOR
        except ImportError:
            print("hello")
        else:
            rich_print("[red]hello[/red]")
        """,
    )
    screen = run_in_terminal(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", "--tee", "3", job],
        leaks.process_env(TERM="xterm", NO_COLOR="1"),
    )
    assert b"[default1]:hello" in screen and b"\x1b[3" not in screen


CHECKPOINTING = """
    import os, sys, time
    import relaunch
    rank = os.environ["RANK"]
    ignore = os.environ.get("IGNORE_STOP") == "1"
    for step in range(100000):
        relaunch.report_progress(step, 100000, "train")
        if step == 5:
            print("training", flush=True)
        if relaunch.stop_requested() and not ignore:
            with open(f"ckpt{rank}.tmp", "w") as file:
                file.write(str(step))
            os.replace(f"ckpt{rank}.tmp", f"ckpt{rank}")  # atomic
            print(f"saved at step {step}", flush=True)
            sys.exit(0)
        time.sleep(0.01)
"""


def start(leaks: LeakCheck, tmp_path, *argv: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "relaunch", *argv],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(**env),
    )


def test_a_first_sigterm_lets_the_workers_checkpoint_and_exit(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(tmp_path, CHECKPOINTING)
    node = start(leaks, tmp_path, "--nproc-per-node", "2", "--tee", "1", job)
    assert node.stdout is not None and node.stdout.readline().endswith("training\n")
    node.send_signal(signal.SIGTERM)
    out, err = node.communicate(timeout=60)
    assert node.returncode == 128 + signal.SIGTERM, err
    assert out.count("saved at step") == 2, out  # both ranks saved
    assert (tmp_path / "ckpt0").exists() and (tmp_path / "ckpt1").exists()
    assert "asking the workers to stop" in err
    summary = err[err.index("run summary") :]
    assert summary.startswith("run summary: stopped by SIGTERM")
    assert "the workers stopped cleanly after the stop request (all exited 0)" in summary
    assert "rank 0 (local 0): exited with code 0" in summary


def test_a_second_signal_stops_the_workers_at_once(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(tmp_path, CHECKPOINTING)
    node = start(leaks, tmp_path, "--nproc-per-node", "2", "--tee", "1", job, IGNORE_STOP="1")
    assert node.stdout is not None and node.stdout.readline().endswith("training\n")
    node.send_signal(signal.SIGINT)
    assert node.stderr is not None
    for line in node.stderr:  # wait until the request is out, then insist
        if "asking the workers to stop" in line:
            break
    started = time.monotonic()
    node.send_signal(signal.SIGINT)
    _, err = node.communicate(timeout=60)
    assert node.returncode == 128 + signal.SIGINT, err
    assert time.monotonic() - started < 20, "not after the 30 s shutdown timeout"
    assert "SIGINT again: the workers were stopped at once" in err


def test_outside_relaunch_the_worker_calls_do_nothing(leaks: LeakCheck) -> None:
    code = (
        "import relaunch, time; t = time.perf_counter(); "
        "[relaunch.report_progress(i, 10) for i in range(1000)]; "
        "print(relaunch.stop_requested(), (time.perf_counter() - t) < 1)"
    )
    env = {k: v for k, v in leaks.process_env().items() if k != "RELAUNCH_CHANNEL"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == ["False", "True"]


def test_the_summary_follows_the_root_cause_report(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(tmp_path, "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = run(leaks, "--nproc-per-node", "2", job)
    assert done.returncode == 1
    assert done.stderr.index("Root cause") < done.stderr.index("run summary: failed")
    assert "rank 1 (local 1): exited with code 3" in done.stderr
    assert "  logs: " in done.stderr


def test_rank_filter_and_prefix_template(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(tmp_path, "import os; print('hello from', os.environ['RANK'])\n")
    done = run(
        leaks,
        "--nproc-per-node",
        "3",
        "--tee",
        "3",
        "--local-ranks-filter",
        "0,2",
        "--log-dir",
        str(tmp_path / "logs"),
        job,
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${role_name}:${rank}/${local_rank}> ",
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "<default:0/0> hello from 0",
        "<default:2/2> hello from 2",
    ]
    [log] = list((tmp_path / "logs").glob("*/attempt_0/1/stdout.log"))
    assert log.read_text() == "hello from 1\n", "the files keep every rank"


def test_status_events_carry_each_workers_progress(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(
        tmp_path,
        """
        import os, relaunch
        relaunch.report_progress(int(os.environ["RANK"]) + 7, 10, "epoch")
    """,
    )
    events = tmp_path / "events.jsonl"
    done = run(leaks, "--nproc-per-node", "2", "--event-log-handler", f"file:{events}", job)
    assert done.returncode == 0, done.stderr
    workers = [json.loads(line) for line in events.read_text().splitlines()]
    progress = {}
    for event in workers:
        inner = json.loads(event["metadata"]["metadata"])
        if event["source"] == "WORKER":
            progress[event["metadata"]["global_rank"]] = inner["progress"]
    assert progress == {
        0: {"step": 7, "total": 10, "desc": "epoch"},
        1: {"step": 8, "total": 10, "desc": "epoch"},
    }


def test_off_a_terminal_the_node_bar_is_printed_each_second_and_at_the_end(
    tmp_path, leaks: LeakCheck
) -> None:
    job = write_job(
        tmp_path,
        """
        import os, time, relaunch
        slow = 0.02 if os.environ["LOCAL_RANK"] == "1" else 0.01
        for step in range(1, 126):
            relaunch.report_progress(step, 125, "train")
            time.sleep(slow)  # 2.5 s for the slowest rank
    """,
    )
    done = run(leaks, "--nproc-per-node", "2", "--tee", "3", job)
    assert done.returncode == 0, done.stderr
    bars = [line for line in done.stderr.splitlines() if line.startswith("[default node 0]:")]
    assert 2 <= len(bars) <= 6, bars
    # Rank 1 is the slowest once it reports; on a loaded machine its start may miss the first
    # bar (once in CI: "95/125 ... slowest: local rank 0", rank 1 not heard yet).
    assert "slowest: local rank 1" in bars[-2] and "step/s" in bars[-2]
    assert "100%|" in bars[-1] and "125/125" in bars[-1], "the final state, always"
    # No --tee off a terminal: the workers write to it themselves, relaunch draws nothing there.
    done = run(leaks, "--nproc-per-node", "2", job)
    assert done.returncode == 0 and "[default node 0]:" not in done.stderr
    # Workers writing straight to a terminal (no --tee): relaunch draws nothing among them.
    screen = run_in_terminal(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", job],
        leaks.process_env(TERM="xterm"),
    )
    assert b"[default node 0]:" not in screen


def test_off_a_terminal_with_no_flags_workers_bytes_pass_untouched(
    tmp_path, leaks: LeakCheck
) -> None:
    job = write_job(tmp_path, BARS)
    done = run(leaks, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), job)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):  # every refresh, as written (bars are collapsed for --tee only)
        assert len(re.findall(rf"rank {rank} +\d+%\|", done.stderr)) == 100
        for step in (25, 50, 75, 100):  # no prefix, as torchrun prints them
            assert f"rank {rank} reached {step}\n" in done.stdout
    # Two workers' file or pipe streams go through relaunch (whole lines, so ranks never mix
    # within one), which logs every byte of them as well.
    for rank in (0, 1):
        (err_log,) = (tmp_path / "logs").glob(f"*/attempt_0/{rank}/stderr.log")
        assert len(re.findall(rf"rank {rank} +\d+%\|", err_log.read_text())) == 100


def test_on_a_terminal_with_no_flags_workers_keep_the_terminal(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(
        tmp_path,
        """
        import sys
        print("terminal", sys.stdout.isatty(), sys.stderr.isatty(), sys.stdin.isatty())
        sys.stderr.write("\\r 10%\\r 20%\\r100%\\n")
        """,
    )
    screen = run_in_terminal(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "1", job],
        leaks.process_env(TERM="xterm"),
    )
    assert b"terminal True True True" in screen and b"\r 10%\r 20%\r100%" in screen


LIVE_DISPLAY = r"""
    import os, sys, time
    # What Rich's live display writes: colours, the area erased (return, erase, up, erase),
    # log lines printed above it, the area drawn again; the cursor hidden meanwhile.
    rank = os.environ["LOCAL_RANK"]
    size = os.get_terminal_size(sys.stderr.fileno())
    out = sys.stderr
    out.write(f"terminal {sys.stdout.isatty()} {out.isatty()} {size.columns}x{size.lines}\n")
    out.write("\x1b[?25l")
    for step in range(1, 31):
        if step > 1:
            out.write("\r\x1b[2K\x1b[1A\x1b[2K")
        if step % 10 == 0:
            out.write(f"\x1b[1mrank {rank} saved {step}\x1b[0m\n")
        out.write(f"Epoch 0 \x1b[35m{'━' * (step // 3)}\x1b[0m {step}/30\nloss {1 / step:.3f}")
        out.flush()
        time.sleep(0.02)
    out.write("\x1b[?25h\n")
    print(f"rank {rank} done")
"""


def test_on_a_terminal_tee_gives_each_worker_a_terminal_of_its_own(
    tmp_path, leaks: LeakCheck
) -> None:
    from relaunch.core.output.screen import ScreenFramer

    job = write_job(tmp_path, LIVE_DISPLAY)
    env = leaks.process_env(TERM="xterm", COLUMNS="100", LINES="30")
    env.pop("NO_COLOR", None)
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "2", "--tee", "3", "--log-dir", str(logs), job]
    screen = run_in_terminal([sys.executable, "-m", "relaunch", *argv], env)
    # What the user's terminal shows at the end, read by relaunch's own terminal model.
    framer = ScreenFramer()
    shown = framer.feed(screen.replace(b"\r\n", b"\n"))[0] + framer.flush()
    plain = ANSI.sub(b"", shown).decode()
    for rank in (0, 1):
        prefix = f"[default{rank}]:"
        # 100 columns less the prefix and one, both streams a terminal
        assert f"{prefix}terminal True True 88x30" in plain
        for step in (10, 20, 30):  # each log line once, under its prefix, never erased
            assert plain.count(f"{prefix}rank {rank} saved {step}\n") == 1, plain
        assert f"{prefix}Epoch 0 ━━━━━━━━━━ 30/30\n{prefix}loss 0.033\n" in plain
        assert f"{prefix}rank {rank} done" in plain
    assert b"\x1b[1m" in screen and b"\x1b[35m" in screen, "the worker's colours are kept"
    [log] = list(logs.glob("*/attempt_0/1/stderr.log"))
    raw = log.read_bytes()
    assert raw.count(b"\r\x1b[2K\x1b[1A\x1b[2K") == 29 and b"\r\n" not in raw, "every byte"


RICH_AND_TQDM = r"""
    import os, sys, time
    from rich.console import Console
    from rich.progress import Progress
    from tqdm import tqdm

    rank = os.environ["LOCAL_RANK"]
    with Progress(console=Console(file=sys.stderr), refresh_per_second=20) as progress:
        task = progress.add_task(f"rank {rank} train", total=40)
        for step in range(1, 41):
            progress.advance(task)
            if step % 20 == 0:
                progress.console.print(f"rank {rank} checkpoint {step}")
            time.sleep(0.01)
    for _ in tqdm(range(30), desc=f"rank {rank} eval", mininterval=0):
        time.sleep(0.005)
    print(f"rank {rank} done")
"""


def test_real_rich_and_tqdm_bars_draw_under_their_prefix_at_the_terminals_width(
    tmp_path, leaks: LeakCheck
) -> None:
    pytest.importorskip("rich")
    pytest.importorskip("tqdm")
    from relaunch.core.output.screen import ScreenFramer

    job = write_job(tmp_path, RICH_AND_TQDM)
    env = leaks.process_env(TERM="xterm", COLUMNS="100", LINES="30")
    env.pop("NO_COLOR", None)
    screen = run_in_terminal(
        [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", "--tee", "3", job], env
    )
    framer = ScreenFramer()
    shown = framer.feed(screen.replace(b"\r\n", b"\n"))[0] + framer.flush()
    lines = ANSI.sub(b"", shown).decode().splitlines()
    for rank in (0, 1):
        prefix = f"[default{rank}]:"
        mine = [line for line in lines if line.startswith(prefix)]
        for step in (20, 40):  # Rich's lines printed above its live bar, under the prefix
            assert mine.count(f"{prefix}rank {rank} checkpoint {step}") == 1, lines
        [rich_bar] = [line for line in mine if f"rank {rank} train" in line]
        assert "━━━━━━━━━━" in rich_bar, "Rich drew its bar (it draws nothing in a pipe)"
        [tqdm_bar] = [line for line in mine if f"rank {rank} eval" in line]
        # tqdm fills its terminal (88 columns) but the last: with the prefix, 98 of 100
        assert "30/30" in tqdm_bar and len(tqdm_bar) == 98, tqdm_bar
        assert f"{prefix}rank {rank} done" in mine
    unprefixed = [line for line in lines if re.search(r"checkpoint|eval|train", line)]
    assert all(line.startswith("[default") for line in unprefixed), "no prefix erased"


RESIZED = r"""
    import os, signal, sys
    # Blocked, then waited for: one that comes before the wait stays pending. (A handler that
    # sets a threading.Event can deadlock: run between the wait's taking the Event's lock and
    # its letting go, it waits for that lock forever.)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})

    def size():
        columns, lines = os.get_terminal_size(sys.stdout.fileno())
        return f"{columns}x{lines}"

    print("size", size(), flush=True)
    if signal.sigtimedwait({signal.SIGWINCH}, 30) is None:
        sys.exit("no SIGWINCH came")
    print("resized", size(), flush=True)
"""


def read_until(fd: int, output: bytearray, done: Callable[[bytes], bool], timeout: float) -> None:
    """Read the terminal ``fd`` into ``output`` until ``done(output)``; fail at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done(ANSI.sub(b"", bytes(output))):
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], output.decode(errors="replace")
        output.extend(os.read(fd, 65536))


def test_a_resized_terminal_resizes_the_workers_terminals(tmp_path, leaks: LeakCheck) -> None:
    job = write_job(tmp_path, RESIZED)
    env = leaks.process_env(TERM="xterm")
    for name in ("COLUMNS", "LINES"):
        env.pop(name, None)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    argv = [sys.executable, "-m", "relaunch", "--nproc-per-node", "2", "--tee", "3", job]
    launcher = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    output = bytearray()
    try:
        read_until(master, output, lambda text: text.count(b"]:size 88x30") == 2, 30)
        # What a terminal does when its window shrinks: a new size, SIGWINCH to the program.
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 20, 80, 0, 0))
        launcher.send_signal(signal.SIGWINCH)
        read_until(master, output, lambda text: b"run summary: succeeded" in text, 30)
        assert launcher.wait(10) == 0, output.decode(errors="replace")
        plain = ANSI.sub(b"", bytes(output))
        assert b"[default0]:resized 68x20" in plain and b"[default1]:resized 68x20" in plain
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        os.close(master)
