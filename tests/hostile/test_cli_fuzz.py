"""A bounded fuzz of the ``relaunch`` command line: a few hundred argv vectors, fixed seed.

Vectors are built from the real flag names (both spellings, short forms, switches, unknown and
duplicated flags) with hostile values (empty, negative, huge, inf/nan, text that was not UTF-8,
control characters, paths to files, directories, nowhere and under a file). Each goes through
``relaunch.cli.command.prepare``: everything ``relaunch ARGV`` does before it starts anything
(the flags, the config, the paths, the open-file limit). Every outcome is a launch it would run
(0), ``--help`` (0) or a usage error: exit 2, exactly one line on stderr, no traceback; any
other exception is a bug. A sample of the usage errors is then run as the real command, which
must say the same line.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import LeakCheck
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relaunch.cli.command import prepare
from relaunch.cli.flags import FLAGS

pytestmark = pytest.mark.timeout(120)

#: A fixed, empty-ish place for every path the vectors name (created once per module).
ROOT = Path(os.environ.get("RELAUNCH_FUZZ_ROOT") or f"{tempfile.gettempdir()}/relaunch-cli-fuzz")

NAMES = sorted(
    {
        spelling
        for flag in FLAGS
        for name in flag.names
        for spelling in (name, "--" + name[2:].replace("-", "_") if name.startswith("--") else name)
    }
)
SWITCHES = {name for flag in FLAGS if flag.switch for name in flag.names}

HOSTILE = [
    "",
    " ",
    "0",
    "1",
    "-1",
    "2",
    "3",
    "1024",
    "1025",
    "65536",
    "99999999999999999999999",
    "1e308",
    "1e-308",
    "inf",
    "-inf",
    "nan",
    "0x10",
    "1_000",
    "٣",
    "²",
    "\udcff\udcfe",  # bytes that were not UTF-8, as Python decodes argv
    "é",
    "a\nb",
    "\x1b[2J",
    "1:2",
    "2:1",
    "0:0",
    ":",
    "::",
    "0:3,1:9",
    "a=b,c",
    "=",
    "timeout=nan",
    "join_timeout=inf,timeout=1e300",
    "is_host=maybe",
    "SIGKILL",
    "SIGSTOP",
    "term,int",
    "SIGRTMIN",
    "31",
    "cpu",
    "gpu",
    "auto",
    "gpu:",
    "gpu:0-99999",
    "gpu:3,3",
    "static",
    "etcd",
    "c10d",
    "zookeeper",
    "null",
    "console",
    "file:",
    "jsonl:x",
    "127.0.0.1:0",
    "[::1]:70000",
    "h:-1",
    "http://",
    "spawn",
    "fork",
    "node",
    "--",
    "-",
    "--tee",
    "1:30",
    "30:1",
    "0:0",
]
PATHS = ["file", "dir", "nowhere/deep", "file/under", "link", "", "dir/new.jsonl"]


def path_value(name: str, prefix: str = "") -> str:
    return prefix + (str(ROOT / name) if name else "")


#: A value each flag takes, so that a vector gets past its sane flags to the deeper checks.
SANE = {
    "nnodes": "1",
    "nproc_per_node": "2",
    "node_rank": "0",
    "master_addr": "127.0.0.1",
    "master_port": "0",
    "local_addr": "127.0.0.1",
    "health_check": "true",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "127.0.0.1:29400",
    "rdzv_id": "job",
    "rdzv_conf": "timeout=5",
    "max_restarts": "1",
    "restart_backoff": "0",
    "signals_to_handle": "SIGTERM",
    "role": "trainer",
    "start_method": "spawn",
    "numa_binding": "node",
    "log_dir": str(ROOT / "logs"),
    "redirects": "3",
    "tee": "0:1",
    "local_ranks_filter": "0",
    "event_log_handler": "file:" + str(ROOT / "events.jsonl"),
    "metrics_port": "0",
    "straggler_factor": "2",
}


def sane(name: str) -> str:
    return SANE.get(name.lstrip("-").replace("-", "_"), "1")


values = st.one_of(
    st.sampled_from(HOSTILE),
    st.sampled_from(PATHS).map(path_value),
    st.sampled_from(PATHS).map(lambda p: path_value(p, "file:")),
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
        max_size=12,
    ),
)
option = st.one_of(
    st.sampled_from(NAMES).map(lambda name: [name] if name in SWITCHES else [name, sane(name)]),
    st.sampled_from(NAMES).map(lambda name: [name] if name in SWITCHES else [name, sane(name)]),
    st.tuples(st.sampled_from(NAMES), values).map(
        lambda nv: [nv[0]] if nv[0] in SWITCHES else list(nv)
    ),
    st.tuples(st.sampled_from(NAMES), values).map(
        lambda nv: [nv[0]] if nv[0] in SWITCHES else [f"{nv[0]}={nv[1]}"]
    ),
    st.sampled_from(
        [["--bogus"], ["--bogus=1"], ["-x"], ["-h"], ["--nproc"], ["-r3"], ["-t"]]
    ).filter(lambda _: True),
)
scripts = st.sampled_from(
    [[str(ROOT / "job.py")], [str(ROOT / "job.py"), "--lr", "inf"], ["missing.py"], ["true"], []]
)


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    argv: list[str] = []
    for part in draw(st.lists(option, max_size=6)):
        argv += part
    return argv + draw(scripts)


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result = prepare(argv)
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:  # --help
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def fuzz_root() -> Path:
    ROOT.mkdir(exist_ok=True)
    (ROOT / "file").write_text("")
    (ROOT / "dir").mkdir(exist_ok=True)
    (ROOT / "job.py").write_text("pass\n")
    if not (ROOT / "link").is_symlink():
        (ROOT / "link").symlink_to(ROOT / "file")
    return ROOT


def test_every_vector_is_a_launch_help_or_one_line_usage_error(
    fuzz_root: Path, monkeypatch: pytest.MonkeyPatch, leaks: LeakCheck
) -> None:
    monkeypatch.chdir(fuzz_root)
    for name in [n for n in os.environ if n.startswith(("PET_", "TORCHELASTIC_", "SLURM_"))]:
        monkeypatch.delenv(name)
    usage_errors: dict[str, tuple[list[str], str]] = {}  # one vector for each kind of error

    @settings(
        derandomize=True,
        max_examples=400,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(argvs())
    def check(argv: list[str]) -> None:
        code, out, err = run_in_process(argv)
        assert code in (0, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2:
            lines = err.splitlines()
            assert len(lines) == 1 and err.endswith("\n"), (argv, err)
            assert lines[0].startswith("relaunch: error: "), (argv, err)
            assert lines[0].isprintable(), (argv, err)
            usage_errors.setdefault(lines[0].split(":")[2][:40], (argv, lines[0]))
        elif "-h" not in argv:
            assert err == "" and out == "", (argv, out, err)

    check()
    assert len(usage_errors) > 10, "the vectors reach many different checks"
    # The real command says the same line as the in-process one.
    for argv, line in sorted(usage_errors.values())[:12]:
        done = subprocess.run(
            [sys.executable, "-m", "relaunch", *argv],
            capture_output=True,
            env={**leaks.process_env(), "PYTHONIOENCODING": "utf-8:backslashreplace"},
            cwd=fuzz_root,
            timeout=30,
        )
        stderr = done.stderr.decode("utf-8", "backslashreplace")
        assert done.returncode == 2, (argv, stderr)
        assert stderr.splitlines() == [line], argv
