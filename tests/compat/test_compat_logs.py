"""torch >= 2.2's logging API through relaunch, beside torch 2.13 as the reference.

``DefaultLogsSpecs(log_dir, redirects, tee, local_ranks_filter).reify(envs)`` gives the same
``LogsDest`` layout; ``start_processes(..., logs_specs)`` writes the same files with the same
bytes; a user's own ``LogsSpecs`` works in both; ``TailLog`` takes ``log_line_prefixes`` and
``log_line_filter``; ``LocalElasticAgent(spec, logs_specs, log_line_prefix_template=...)`` puts
its logs and console lines where torch's does. The seeds' forms (``log_dir``, ``redirects``,
``tee``) keep working, and mixing the two forms is a one-line TypeError. The ``relaunch``
command takes torchrun's ``--logs-specs`` and ``--local-ranks-filter``.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from compat_logs_fns import CustomLogsSpecs
from conftest import LeakCheck, relaunch_cli

from relaunch import LaunchConfig, elastic_launch
from relaunch.config import ConfigError
from relaunch.core.workers.logs_dest import LogsDest
from relaunch.core.workers.logs_specs import rank_io_of
from relaunch.core.workers.rank_io import DEVNULL
from relaunch.endpoints import find_free_port
from relaunch.procs import DefaultLogsSpecs, Std, TailLog, start_processes

pytestmark = pytest.mark.xdist_group("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
FNS = os.path.join(HERE, "compat_logs_fns.py")
ENVS = {
    0: {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"},
    1: {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"},
    2: {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"},
}


def torch_mp() -> Any:
    import torch.distributed.elastic.multiprocessing as mp

    return mp


def relative(value: Any, root: str, run_dir: str) -> Any:
    """``value`` (a path, or maps of them) with the run's directory as ``<run>``."""
    if isinstance(value, dict):
        return {key: relative(item, root, run_dir) for key, item in value.items()}
    if isinstance(value, str) and value.startswith(run_dir):
        return "<run>" + value[len(run_dir) :]
    return value


def run_dir_of(root: str) -> str:
    (name,) = os.listdir(root)
    return os.path.join(root, name)


def reified(module: Any, root: str, **kw: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``module``'s ``DefaultLogsSpecs(root, **kw).reify`` of three ranks: its ``LogsDest``
    with the run's directory as ``<run>``, and the error files it gave the workers."""
    envs = {rank: dict(env) for rank, env in ENVS.items()}
    dest = module.DefaultLogsSpecs(root, **kw).reify(envs)
    run_dir = run_dir_of(root)
    assert os.path.basename(run_dir).startswith("job7_")
    fields = {name: getattr(dest, name) for name in LogsDest.__dataclass_fields__}
    errors = {str(rank): env["TORCHELASTIC_ERROR_FILE"] for rank, env in envs.items()}
    return relative(fields, root, run_dir), relative(errors, root, run_dir)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"redirects": "ALL"},
        {"redirects": {0: "ERR"}, "tee": {1: "OUT", 2: "ALL"}},
        {"tee": "ALL", "local_ranks_filter": {0, 2}},
        {"redirects": "OUT", "local_ranks_filter": {1}},
        {"local_ranks_filter": set()},
    ],
    ids=["nothing", "redirect-all", "per-rank", "tee-filtered", "filter-drops", "empty-filter"],
)
def test_default_logs_specs_reify_like_torch(tmp_path: Path, kw: dict[str, Any]) -> None:
    def spelled(module: Any) -> dict[str, Any]:
        def std(value: Any) -> Any:
            if isinstance(value, dict):
                return {rank: module.Std[name] for rank, name in value.items()}
            return module.Std[value]

        return {k: std(v) if k in ("redirects", "tee") else v for k, v in kw.items()}

    relaunch_procs = sys.modules["relaunch.procs"]
    theirs = reified(torch_mp(), str(tmp_path / "torch"), **spelled(torch_mp()))
    ours = reified(relaunch_procs, str(tmp_path / "ours"), **spelled(relaunch_procs))
    assert ours == theirs
    for rank in range(3):  # the ranks' directories are made, as torch's
        assert any((tmp_path / "ours").glob(f"job7_*/attempt_2/{rank}"))


def test_default_logs_specs_dropped_ranks_go_to_devnull(tmp_path: Path) -> None:
    dest = DefaultLogsSpecs(str(tmp_path), redirects=Std.OUT, local_ranks_filter={1}).reify(
        {rank: dict(env) for rank, env in ENVS.items()}
    )
    assert dest.stderrs[0] == DEVNULL and dest.stderrs[2] == DEVNULL and dest.stderrs[1] == ""
    assert all(path.endswith("stdout.log") for path in dest.stdouts.values())


def test_default_logs_specs_devnull_and_constructor_like_torch(tmp_path: Path) -> None:
    mp = torch_mp()
    envs_t = {rank: dict(env) for rank, env in ENVS.items()}
    envs_o = {rank: dict(env) for rank, env in ENVS.items()}
    theirs = mp.DefaultLogsSpecs(os.devnull, tee=mp.Std.ALL).reify(envs_t)
    ours = DefaultLogsSpecs(os.devnull, tee=Std.ALL).reify(envs_o)
    assert ours.__dict__ == theirs.__dict__ and envs_o == envs_t
    # A file is no directory; a missing one is made; None is a new temporary one.
    afile = tmp_path / "afile"
    afile.write_text("")
    for module in (mp, sys.modules["relaunch.procs"]):
        with pytest.raises(NotADirectoryError, match="is a file"):
            module.DefaultLogsSpecs(str(afile))
        made = tmp_path / f"made-{module.__name__}" / "deeper"
        assert module.DefaultLogsSpecs(str(made)).root_log_dir == str(made) and made.is_dir()
        assert os.path.isdir(module.DefaultLogsSpecs().root_log_dir)
    assert DefaultLogsSpecs(str(tmp_path), Std.OUT) == DefaultLogsSpecs(str(tmp_path), Std.OUT)
    assert DefaultLogsSpecs(str(tmp_path), Std.OUT) != DefaultLogsSpecs(str(tmp_path))
    assert repr(DefaultLogsSpecs(str(tmp_path))) == repr(mp.DefaultLogsSpecs(str(tmp_path)))


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its path, the run's random directory as ``<run>``."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            parts = path.relative_to(root).parts
            parts = tuple(
                "<run>" if "_" in part and i == 0 else part for i, part in enumerate(parts)
            )
            found["/".join(parts)] = path.read_bytes()
    return found


ECHO = """
import sys
rank = sys.argv[1]
for i in range(3):
    print(f"out {rank} line {i}", flush=True)
    print(f"err {rank} line {i}", file=sys.stderr, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make_specs",
    [
        lambda mp, root: mp.DefaultLogsSpecs(
            root, redirects={0: mp.Std.ERR, 1: mp.Std.ALL}, tee={0: mp.Std.OUT}
        ),
        lambda mp, root: CustomLogsSpecs(root),
        lambda mp, root: torch_mp().DefaultLogsSpecs(root, tee=torch_mp().Std.ALL),
    ],
    ids=["default", "user-subclass", "torchs-class-in-both"],
)
def test_start_processes_with_logs_specs_writes_torchs_files(
    tmp_path: Path, make_specs: Callable[[Any, str], Any], leaks: LeakCheck
) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    roots = {}
    for name, module, start in (
        ("torch", torch_mp(), torch_mp().start_processes),
        ("ours", sys.modules["relaunch.procs"], start_processes),
    ):
        root = tmp_path / name
        envs = {rank: {**ENVS[rank], **leaks.env} for rank in (0, 1)}
        pc = start(
            "echo",
            sys.executable,
            {0: ("-u", str(script), "0"), 1: ("-u", str(script), "1")},
            envs,
            make_specs(module, str(root)),
            {0: "[zero]:"},
        )
        try:
            result = pc.wait(60)
            assert result is not None and not result.is_failed(), result
        finally:
            pc.close()
        roots[name] = root
    ours, theirs = files_under(roots["ours"]), files_under(roots["torch"])
    assert ours == theirs
    assert any(b"out 0 line 2\n" in data for data in ours.values())


@pytest.mark.timeout(120)
def test_duplicate_filters_copy_the_teed_lines_like_torch(tmp_path: Path, leaks: LeakCheck) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    copied = {}
    for name, module in (("torch", torch_mp()), ("ours", sys.modules["relaunch.procs"])):
        pc = module.start_processes(
            "echo",
            sys.executable,
            {0: ("-u", str(script), "0"), 1: ("-u", str(script), "1")},
            {rank: {**ENVS[rank], **leaks.env} for rank in (0, 1)},
            module.DefaultLogsSpecs(
                str(tmp_path / name),
                redirects={0: module.Std.ERR},
                tee={0: module.Std.OUT, 1: module.Std.ERR},
            ),
            {0: "[zero]:"},
            duplicate_stdout_filters=["line 1"],
            duplicate_stderr_filters=["line 0", "line 2"],
        )
        try:
            result = pc.wait(60)
            assert result is not None and not result.is_failed(), result
        finally:
            pc.close()
        paths = [getattr(pc.filtered_stdout, "name", pc.filtered_stdout), pc.filtered_stderr]
        paths[1] = getattr(paths[1], "name", paths[1])
        assert [os.path.basename(str(path)) for path in paths] == [
            "filtered_stdout.log",
            "filtered_stderr.log",
        ]
        copied[name] = [sorted(Path(str(path)).read_text().splitlines()) for path in paths]
    assert copied["ours"] == copied["torch"]
    assert copied["ours"] == [
        ["[zero]:out 0 line 1"],
        ["[echo1]:err 1 line 0", "[echo1]:err 1 line 2"],
    ]


def test_start_processes_forms_are_told_apart_and_not_mixed(log_dir: str) -> None:
    one = {"name": "echo", "entrypoint": "/bin/true", "args": {0: ()}, "envs": {0: {}}}
    with pytest.raises(TypeError, match=r"log_dir= of the seeds' form .* DefaultLogsSpecs"):
        start_processes(**one, logs_specs=DefaultLogsSpecs(log_dir), log_dir=log_dir)
    with pytest.raises(TypeError, match="tee= of the seeds' form"):
        start_processes(*one.values(), DefaultLogsSpecs(log_dir), tee=Std.ALL)
    with pytest.raises(TypeError, match=r"numa_options= of torch 2\.13's form"):
        start_processes(*one.values(), log_dir, numa_options=None)
    with pytest.raises(TypeError, match=r"a logs_specs .* or a log_dir .* 5th argument, got int"):
        start_processes(*one.values(), 3)
    with pytest.raises(TypeError, match="needs where logs go"):
        start_processes(**one)
    with pytest.raises(TypeError, match="multiple values for argument 'start_method'"):
        start_processes(*one.values(), log_dir, "spawn", start_method="fork")
    with pytest.raises(TypeError, match="at most 5 arguments"):
        start_processes(*one.values(), log_dir, "spawn", 0, 0, None, "extra")


@pytest.mark.timeout(60)
def test_the_seeds_form_still_works(log_dir: str, leaks: LeakCheck) -> None:
    pc = start_processes(
        "echo", "/bin/echo", {0: ("hi",)}, {0: leaks.env}, Path(log_dir), "spawn", Std.OUT
    )
    result = pc.wait(30)
    pc.close()
    assert result is not None and Path(result.stdouts[0]).read_text() == "hi\n"
    assert result.stdouts[0] == os.path.join(log_dir, "0", "stdout.log")


def test_a_logs_dest_becomes_the_plan_once() -> None:
    dest = LogsDest(
        stdouts={0: "/l/0.out", 1: ""},
        stderrs={0: "", 1: DEVNULL},
        tee_stdouts={0: "/l/0.out", 1: DEVNULL},
        error_files={0: "/l/0/error.json", 1: DEVNULL},
    )
    plan = rank_io_of(dest, "w", 2, {1: "<one>"}, Std.ALL)
    assert (plan[0].stdout, plan[0].tee, plan[0].relay) == ("/l/0.out", Std.OUT, Std.ERR)
    assert (plan[0].log_dir, plan[0].prefix) == ("/l/0", "[w0]:")
    assert (plan[1].stderr, plan[1].tee, plan[1].relay) == (DEVNULL, Std.NONE, Std.OUT)
    assert (plan[1].error_file, plan[1].prefix) == ("", "<one>")
    with pytest.raises(RuntimeError, match=r"stderrs has no path for local ranks \[1\]"):
        rank_io_of(LogsDest(stdouts={0: "", 1: ""}, stderrs={0: ""}), "w", 2)
    with pytest.raises(ValueError, match="tees local rank 0's stdout from '/x'"):
        rank_io_of(LogsDest({0: "/y"}, {0: ""}, tee_stdouts={0: "/x"}), "w", 1)


class Lines(io.StringIO):
    """A console that keeps what it was given."""


def tail_with(make: Callable[..., Any], files: dict[int, str], **kw: Any) -> list[str]:
    dst = Lines()
    tail = make("w", files, dst, **kw).start()
    tail.stop()
    assert tail.stopped()
    return sorted(dst.getvalue().splitlines())


@pytest.mark.timeout(60)
def test_tail_log_prefixes_and_filter_like_torch(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog as TorchTailLog

    files = {}
    for rank in (0, 1):
        path = tmp_path / f"{rank}.log"
        path.write_text("".join(f"line {n} of {rank}\nkeep {n} of {rank}\n" for n in range(3)))
        files[rank] = str(path)
    for kw in (
        {},
        {"log_line_prefixes": {1: "<one> "}},
        {"log_line_filter": lambda line: line.startswith("keep") and line.endswith("\n")},
        {"log_line_prefixes": {0: "Z:"}, "interval_sec": 0.01, "log_line_filter": lambda _: False},
    ):
        ours = tail_with(TailLog, files, **kw)
        assert ours == tail_with(TorchTailLog, files, **kw), kw
    assert "<one> keep 2 of 1" in tail_with(TailLog, files, log_line_prefixes={1: "<one> "})
    # torch's positional order, and the seeds' (a number 4th: the interval).
    assert tail_with(lambda *a: TailLog(*a, {0: ">"}, 0.01, lambda s: "2" in s), files)[0] == (
        ">keep 2 of 0"
    )
    assert tail_with(lambda *a: TailLog(*a, 0.01), files)[0] == "[w0]:keep 0 of 0"
    with pytest.raises(TypeError, match=r"TailLog\(\) takes a log_line_prefixes"):
        TailLog("w", files, Lines(), "0.1")


def test_tail_logfile_like_torch(tmp_path: Path) -> None:
    import threading

    from torch.distributed.elastic.multiprocessing.tail_log import tail_logfile as theirs

    from relaunch.procs.tail import tail_logfile as ours

    path = tmp_path / "0.log"
    path.write_text("keep a\ndrop b\nkeep c\n")
    finished = threading.Event()
    finished.set()  # read what there is, then return
    copied = []
    for tail in (theirs, ours):
        dst = Lines()
        tail("<h>", str(path), dst, finished, 0.01, lambda line: line.startswith("keep"))
        tail("<h>", str(tmp_path / "never.log"), dst, finished, 0.01, lambda line: True)
        copied.append(dst.getvalue())
    assert copied[0] == copied[1] == "<h>keep a\n<h>keep c\n"


@pytest.mark.timeout(60)
def test_tail_log_filter_that_raises_is_said_not_fatal(tmp_path: Path, caplog: Any) -> None:
    path = tmp_path / "0.log"
    path.write_text("a\n")

    def bad(line: str) -> bool:
        raise KeyError(line)

    assert tail_with(TailLog, {0: str(path)}, log_line_filter=bad) == []
    assert "error tailing log files" in caplog.text


def run_agent_node(task: dict[str, Any], leaks: LeakCheck, timeout: float = 90) -> tuple[Any, str]:
    env = leaks.process_env(PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, FNS, json.dumps(task)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    outcome = json.loads(lines[-1])
    assert "error" not in outcome, done.stderr[-3000:]
    return outcome, "\n".join(lines[:-1])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("custom", [False, True], ids=["default", "user-subclass"])
def test_agent_with_logs_specs_and_prefix_template_like_torch(
    tmp_path: Path, leaks: LeakCheck, custom: bool
) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    outputs, files = {}, {}
    for kind in ("torch", "relaunch"):
        root = tmp_path / kind
        task = {
            "kind": kind,
            "endpoint": f"127.0.0.1:{find_free_port()}",
            "run_id": f"logs-{uuid.uuid4().hex[:6]}",
            "role": "trainer",
            "nproc": 2,
            "script": str(script),
            "log_dir": str(root),
            "redirects": int(Std.ERR),
            "tee": int(Std.OUT),
            "template": "<${role_name}:${rank}/${local_rank}> ",
            "custom": custom,
            "filters": None if custom else ["line 1"],
        }
        outcome, console = run_agent_node(task, leaks)
        assert outcome == {"failed": False, "returns": [0, 1]}
        if kind == "torch":  # its tee may write two ranks' lines into one: each record counts
            outputs[kind] = sorted(re.findall(r"<trainer:\d/\d> \w+ \d line \d", console))
        else:  # each line whole
            outputs[kind] = sorted(line for line in console.splitlines() if "line" in line)
        files[kind] = files_under(root)
        for name in [name for name in files[kind] if name.endswith("filtered_stdout.log")]:
            # Every rank's lines in one file: their order is the order they came in.
            files[kind][name] = b"".join(sorted(files[kind][name].splitlines(keepends=True)))
    assert files["relaunch"] == files["torch"]
    assert outputs["relaunch"] == outputs["torch"]
    if custom:
        assert outputs["relaunch"] == [f"<trainer:0/0> out 0 line {n}" for n in range(3)]
        assert set(files["relaunch"]) == {"0/rank0.out", "0/rank1.out", "0/rank0.err"}
    else:
        assert "<trainer:1/1> out 1 line 2" in outputs["relaunch"]
        assert "<run>/attempt_0/1/stderr.log" in files["relaunch"]
        filtered = files["relaunch"]["<run>/attempt_0/filtered_stdout.log"].splitlines()
        assert sorted(filtered) == [b"<trainer:0/0> out 0 line 1", b"<trainer:1/1> out 1 line 1"]


def test_agent_forms_are_told_apart_and_not_mixed(tmp_path: Path) -> None:
    from relaunch.agent import LocalElasticAgent, WorkerSpec

    spec = WorkerSpec("w", 1, rdzv_handler=object(), entrypoint="/bin/true")  # type: ignore[arg-type]
    specs = DefaultLogsSpecs(str(tmp_path))
    with pytest.raises(TypeError, match="log_dir= of the seeds' form"):
        LocalElasticAgent(spec, specs, log_dir=str(tmp_path))
    with pytest.raises(TypeError, match="events= of the seeds' form"):
        LocalElasticAgent(spec, specs, "spawn", 30, None, events=object())
    with pytest.raises(TypeError, match="at most 7 arguments from logs_specs on"):
        LocalElasticAgent(spec, specs, "spawn", 30, None, 5, None, None, "one too many")
    with pytest.raises(TypeError, match=r"a logs_specs .* or a start_method .* got int"):
        LocalElasticAgent(spec, 3)
    with pytest.raises(ValueError, match="health_check_server is torch's own and not taken"):
        LocalElasticAgent(spec, specs, "spawn", 30, None, 5, object())
    spec.redirects = Std.ALL
    with pytest.raises(ValueError, match=r"WorkerSpec\(redirects=, tee=\) is the seeds' form"):
        LocalElasticAgent(spec, specs)


def trainer(tag: str) -> str:
    return tag + os.environ["LOCAL_RANK"]


@pytest.mark.timeout(120)
def test_launch_config_takes_logs_specs_and_the_prefix_template(
    tmp_path: Path, leaks: LeakCheck, capfd: Any
) -> None:
    logs = tmp_path / "logs"
    config = LaunchConfig(
        1,
        1,
        2,
        rdzv_endpoint="127.0.0.1:0",
        logs_specs=DefaultLogsSpecs(str(logs), tee=Std.OUT, local_ranks_filter={1}),
        log_line_prefix_template="[${rank}]",
    )
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    os.environ.update(leaks.env)
    try:
        elastic_launch(config, sys.executable)("-u", str(script), "${local_rank}")
    finally:
        for name in leaks.env:
            os.environ.pop(name, None)
    shown = [line for line in capfd.readouterr().out.splitlines() if "line" in line]
    assert sorted(shown) == [f"[1]out 1 line {n}" for n in range(3)]
    (run_dir,) = logs.iterdir()
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text().count("out 0 line") == 3
    with pytest.raises(ConfigError, match="leave log_dir, tee out of the LaunchConfig"):
        LaunchConfig(1, 1, 1, log_dir="x", tee=Std.ALL, logs_specs=DefaultLogsSpecs(str(tmp_path)))
    with pytest.raises(ConfigError, match="4th field is run_id: give logs_specs by keyword"):
        LaunchConfig(1, 1, 1, DefaultLogsSpecs(str(tmp_path)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="logs_specs must be a LogsSpecs"):
        LaunchConfig(1, 1, 1, logs_specs="x")  # type: ignore[arg-type]


def entry_point_dir(tmp_path: Path) -> str:
    """A directory that, on ``PYTHONPATH``, installs the ``torchrun.logs_specs`` entry point
    ``custom`` (``compat_logs_fns:CustomLogsSpecs``) and a broken one."""
    info = tmp_path / "site" / "compat_logs-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: compat-logs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [torchrun.logs_specs]
            custom = compat_logs_fns:CustomLogsSpecs
            broken = compat_logs_fns:NoSuchThing
            """
        )
    )
    return str(tmp_path / "site")


@pytest.mark.timeout(120)
def test_cli_logs_specs_from_torchruns_entry_points(tmp_path: Path, leaks: LeakCheck) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    site = entry_point_dir(tmp_path)
    logs = tmp_path / "logs"

    def relaunch(*argv: str) -> subprocess.CompletedProcess[str]:
        path = os.pathsep.join([site, HERE, os.environ.get("PYTHONPATH", "")])
        return subprocess.run(
            [sys.executable, "-m", "relaunch", *argv],
            capture_output=True,
            text=True,
            env=leaks.process_env(PYTHONPATH=path),
            timeout=60,
        )

    done = relaunch(
        "--nproc-per-node", "2", "--logs-specs", "custom", "--log-dir", str(logs), str(script), "x"
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[default0]:out x line {n}" for n in range(3)]
    assert (logs / "0" / "rank1.out").read_text().count("out x line") == 3
    for name, said in (
        ("nope", "no torchrun.logs_specs entry point is named 'nope' (known: "),
        ("broken", "entry point 'broken' (compat_logs_fns:NoSuchThing) cannot be loaded"),
    ):
        done = relaunch("--logs-specs", name, str(script))
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_cli_default_logs_specs_and_torchs_local_ranks_filter(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    logs = tmp_path / "logs"
    done = relaunch_cli(
        leaks,
        "--nproc-per-node",
        "2",
        "--logs-specs",
        "default",
        "-t",
        "1",
        "--local-ranks-filter",
        "0",
        "--log-dir",
        str(logs),
        str(script),
        "y",
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"[default0]:out y line {n}" for n in range(3)]
    shown_err = [line for line in done.stderr.splitlines() if line.startswith("err y")]
    assert sorted(shown_err) == [f"err y line {n}" for n in range(3)]  # rank 0's, inherited
    (run_dir,) = logs.iterdir()
    attempt = run_dir / "attempt_0"
    # Rank 1 is off the console: its tee'd stdout is still on file, its stderr dropped.
    assert (attempt / "1" / "stdout.log").read_text().count("out y line") == 3
    assert not (attempt / "1" / "stderr.log").exists()


@pytest.mark.parametrize("text", ["apple,orange", "a,,b,c", "", ",", "x,,,,y"])
def test_cli_duplicate_filters_parse_like_torchrun(text: str) -> None:
    from torch.distributed.run import get_args_parser

    from relaunch.cli import build_parser

    argv = [f"--duplicate-stdout-filters={text}", f"--duplicate_stderr_filters={text}", "x.py"]
    theirs = get_args_parser().parse_args(argv)
    ours = build_parser({}).parse_args(argv)
    assert ours.duplicate_stdout_filters == theirs.duplicate_stdout_filters
    assert ours.duplicate_stderr_filters == theirs.duplicate_stderr_filters


@pytest.mark.timeout(120)
def test_cli_duplicate_filters_copy_every_ranks_teed_lines(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    logs = tmp_path / "logs"
    done = relaunch_cli(
        leaks,
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        "--duplicate-stdout-filters",
        "line 1",
        "--duplicate-stderr-filters",
        "line 0,line 2",
        "--log-dir",
        str(logs),
        str(script),
        "z",
    )
    assert done.returncode == 0, done.stderr
    (run_dir,) = logs.iterdir()
    attempt = run_dir / "attempt_0"
    assert sorted((attempt / "filtered_stdout.log").read_text().splitlines()) == [
        "[default0]:out z line 1",
        "[default1]:out z line 1",
    ]
    assert sorted((attempt / "filtered_stderr.log").read_text().splitlines()) == [
        f"[default{rank}]:err z line {n}" for rank in (0, 1) for n in (0, 2)
    ]


@pytest.mark.timeout(60)
def test_cli_dry_run_with_the_default_logs_specs_makes_nothing(
    tmp_path: Path, leaks: LeakCheck
) -> None:
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    logs = tmp_path / "not-yet"
    done = relaunch_cli(
        leaks, "--dry-run", "--logs-specs", "default", "--log-dir", str(logs), str(script)
    )
    assert done.returncode == 0, done.stderr
    assert f"log directory: {logs}" in done.stdout and not logs.exists()
