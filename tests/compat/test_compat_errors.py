"""relaunch's ProcessFailure, @record, ErrorHandler and start_processes' argument errors beside
torch.distributed.elastic.multiprocessing's: the same input gives the same fields, the same error
file and the same exception types."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import LeakCheck

from relaunch.procs import errors
from relaunch.procs import start_processes as relaunch_start_processes

pytestmark = pytest.mark.xdist_group("torch")

torch_errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
torch_mp = pytest.importorskip("torch.distributed.elastic.multiprocessing")

HERE = os.path.dirname(os.path.abspath(__file__))

#: The error file @record writes, as a worker leaves it.
RECORD_FILE = {
    "message": {
        "message": "ValueError: boom",
        "extraInfo": {
            "py_callstack": "Traceback (most recent call last):\n  ...\nValueError: boom\n",
            "timestamp": "1700000123",
        },
    }
}


def write(path: str, data: object) -> str:
    with open(path, "w") as file:
        json.dump(data, file)
    return path


def fields(failure: Any) -> dict[str, object]:
    """What a user reads of a ProcessFailure."""
    return {
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "error_file": failure.error_file,
        "error_file_data": failure.error_file_data,
        "message": failure.message,
        "timestamp": failure.timestamp,
        "signal_name": failure.signal_name(),
        "timestamp_isoformat": failure.timestamp_isoformat(),
    }


def both(*args: object) -> tuple[dict[str, object], dict[str, object]]:
    """The fields of torch's and relaunch's ProcessFailure(*args)."""
    return fields(torch_errors.ProcessFailure(*args)), fields(errors.ProcessFailure(*args))


@pytest.mark.parametrize(
    "data",
    [
        RECORD_FILE,
        {"message": "plain text", "timestamp": 1700000456},
        {"message": {"message": "x", "extraInfo": {"timestamp": "17"}}, "extra": [1, 2]},
    ],
    ids=["record-layout", "text-message", "no-callstack"],
)
@pytest.mark.parametrize("exitcode", [1, -11])
def test_an_error_file_gives_the_same_fields(tmp_path, data: dict[str, Any], exitcode: int) -> None:
    path = write(str(tmp_path / "error.json"), data)
    theirs, mine = both(2, 4242, exitcode, path)
    assert mine == theirs
    assert mine["error_file_data"] == data and mine["message"] == data["message"]
    assert isinstance(mine["timestamp"], int)


def test_an_exit_code_without_an_error_file_gives_the_same_fields(tmp_path) -> None:
    before = int(time.time())
    theirs, mine = both(0, 997, 3, str(tmp_path / "never-written.json"))
    after = int(time.time())
    assert before <= int(str(mine.pop("timestamp"))) <= after
    assert before <= int(str(theirs.pop("timestamp"))) <= after
    mine.pop("timestamp_isoformat"), theirs.pop("timestamp_isoformat")
    assert mine == theirs
    assert mine["error_file"] == mine["signal_name"] == "<N/A>"
    data = mine["error_file_data"]
    assert isinstance(data, dict) and data["message"] == "<NONE>"  # no KeyError
    assert data["errorTraits"] == {"category": "system_terminated_error", "retryability": "False"}


@pytest.mark.parametrize(("exitcode", "name"), [(-11, "SIGSEGV"), (-9, "SIGKILL"), (-200, "<N/A>")])
def test_a_signal_death_without_an_error_file_gives_the_same_fields(
    exitcode: int, name: str
) -> None:
    theirs, mine = both(1, 997, exitcode, "")
    for fields_ in (mine, theirs):
        fields_.pop("timestamp"), fields_.pop("timestamp_isoformat")
    # torch adds the errorTraits of an exit code to one dict shared by every failure without an
    # error file, so after the test above its signal deaths carry them too: a torch bug, which
    # relaunch (a dict per failure) does not copy.
    theirs_data = dict(theirs.pop("error_file_data"))  # type: ignore[call-overload]
    theirs_data.pop("errorTraits", None)
    assert mine.pop("error_file_data") == theirs_data == {"message": "<NONE>"}
    assert mine == theirs
    assert mine["message"] == f"Signal {-exitcode} ({name}) received by PID 997"
    assert mine["signal_name"] == name and mine["error_file"] == "<N/A>"


def test_the_root_cause_is_the_earliest_error_file_timestamp(tmp_path) -> None:
    early = dict(RECORD_FILE, message={**RECORD_FILE["message"]})
    early["message"]["extraInfo"] = {"py_callstack": "tb", "timestamp": "1600000000"}
    paths = {
        0: write(str(tmp_path / "0.json"), RECORD_FILE),
        1: write(str(tmp_path / "1.json"), early),
    }

    def first(module: Any) -> tuple[int, object]:
        failures = {rank: module.ProcessFailure(rank, 10 + rank, 1, p) for rank, p in paths.items()}
        rank, failure = module.ChildFailedError("trainer", failures).get_first_failure()
        return rank, failure.timestamp

    assert first(errors) == first(torch_errors) == (1, 1600000000)


def test_relaunchs_report_keeps_its_own_words_where_torch_says_n_a(tmp_path) -> None:
    killed = errors.ProcessFailure.from_exit(0, 997, -9, "", timestamp=time.time())
    exited = errors.ProcessFailure.from_exit(
        1, 998, 3, "", stderr_tail=b"loading shard 7\nValueError: bad shard\n"
    )
    report = str(errors.ChildFailedError("trainer", {0: killed, 1: exited}))
    assert "<N/A>" not in report and "<NONE>" not in report and "error file:" not in report
    assert "SIGKILL: killed from outside" in report
    assert "last lines of stderr (kept in memory):\n    loading shard 7" in report
    assert exited.message == torch_errors.ProcessFailure(1, 998, 3, "").message
    assert killed.message == "Signal 9 (SIGKILL) received by PID 997"


def shape(value: object) -> object:
    """``value`` with each leaf replaced by its type's name: the layout of a JSON document."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def recorded(impl: str, directory: str, leaks: LeakCheck) -> dict[str, dict[str, Any]]:
    """What compat_errors_fns.py's scenarios did under ``impl``'s @record, in a fresh process."""
    os.makedirs(directory)
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "compat_errors_fns.py"), impl, directory],
        capture_output=True,
        text=True,
        env=leaks.process_env(),
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    return results


@pytest.mark.timeout(240)
def test_record_writes_what_torchs_record_writes(tmp_path, leaks: LeakCheck) -> None:
    theirs = recorded("torch", str(tmp_path / "torch"), leaks)
    mine = recorded("relaunch", str(tmp_path / "relaunch"), leaks)
    assert list(mine) == list(theirs)
    for name in mine:
        assert mine[name]["outcome"] == theirs[name]["outcome"], name
    # An exception: the same layout and message; the tracebacks differ in the wrapper's frame.
    raised, theirs_raised = mine.pop("raises")["file"], theirs.pop("raises")["file"]
    assert shape(raised) == shape(theirs_raised)
    assert raised["message"]["message"] == theirs_raised["message"]["message"] == "ValueError: boom"
    assert raised["message"]["extraInfo"]["py_callstack"].endswith('"boom")\nValueError: boom\n')
    assert abs(int(raised["message"]["extraInfo"]["timestamp"]) - time.time()) < 200
    # The rest, a child's error file passed up or nothing at all: the very same files.
    assert mine == theirs
    assert mine["child_without_error_file"]["file"] is None  # not the launcher's own report
    assert mine["child_record_sigsegv"]["file"]["message"]["errorCode"] == -11
    assert mine["child_text_exit_2"]["file"] == {
        "message": "the child failed",
        "timestamp": 1700000001,
    }
    assert mine["exit_0"] == {"outcome": "returned None", "file": None}


class Calls:
    """An ErrorHandler subclass's calls, as torch's docs invite: its own initialize and
    record_exception, and the base class's dump_error_file."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def handler(self, base: type) -> Any:
        calls = self.calls

        class Mine(base):  # type: ignore[misc, valid-type]
            def initialize(self) -> None:
                calls.append(("initialize",))

            def record_exception(self, e: BaseException) -> None:
                calls.append(("record_exception", type(e).__name__, str(e)))

            def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
                calls.append(
                    ("dump_error_file", os.path.basename(rootcause_error_file), error_code)
                )

        return Mine()


def run_decorated(module: Any, record: Callable[..., Any], tmp_path) -> list[tuple[object, ...]]:
    """What happens when ``record``-decorated functions raise, succeed, and pass a child up."""
    child = write(str(tmp_path / "child.json"), RECORD_FILE)

    def fails() -> None:
        raise KeyError("k")

    def launches() -> None:
        failure = module.ProcessFailure(0, 5, -6, child)
        raise module.ChildFailedError("trainer", {0: failure})

    outcomes: list[tuple[object, ...]] = [("returned", record(lambda: 5)())]
    for function in (fails, launches):
        with pytest.raises(Exception) as caught:
            record(function)()
        outcomes.append(("raised", type(caught.value).__name__))
    return outcomes


@pytest.mark.parametrize("how", ["error_handler=", "get_error_handler"])
def test_a_users_error_handler_is_called_as_torch_calls_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    results = []
    for module, base in (
        (torch_errors, torch_errors.ErrorHandler),
        (errors, errors.ErrorHandler),
    ):
        calls = Calls()
        handler = calls.handler(base)
        if how == "error_handler=":

            def record(fn: Callable[..., Any], module: Any = module, handler: Any = handler) -> Any:
                return module.record(fn, error_handler=handler)

        else:
            monkeypatch.setattr(module, "get_error_handler", lambda handler=handler: handler)
            record = module.record
        outcomes = run_decorated(module, record, tmp_path)
        results.append((outcomes, calls.calls))
    assert results[0] == results[1]
    assert results[1][1] == [
        ("initialize",),
        ("initialize",),
        ("record_exception", "KeyError", "'k'"),
        ("initialize",),
        ("dump_error_file", "child.json", -6),
    ]


def test_error_handler_has_torchs_methods() -> None:
    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(errors.ErrorHandler) == public(torch_errors.ErrorHandler)
    for name in ("_get_error_file_path", "_write_error_file"):  # what subclasses override
        assert callable(getattr(errors.ErrorHandler, name))
    assert type(errors.get_error_handler()) is errors.ErrorHandler


@pytest.mark.parametrize("error_code", [0, 1, -9])
@pytest.mark.parametrize("child", [RECORD_FILE, {"message": "text"}, {"no": "message"}])
def test_dump_error_file_copies_the_child_as_torch_does(
    tmp_path, monkeypatch: pytest.MonkeyPatch, error_code: int, child: dict[str, Any]
) -> None:
    child_file = write(str(tmp_path / "child.json"), child)
    written = []
    for name, handler in (("torch", torch_errors.ErrorHandler()), ("mine", errors.ErrorHandler())):
        mine = str(tmp_path / f"{name}.json")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", mine)
        handler.dump_error_file(child_file, error_code)
        with open(mine) as file:
            written.append(json.load(file))
    assert written[0] == written[1]
    if error_code and child is RECORD_FILE:
        assert written[1]["message"]["errorCode"] == error_code


def test_record_exception_without_an_error_file_writes_nothing(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    for handler in (torch_errors.ErrorHandler(), errors.ErrorHandler()):
        handler.record_exception(ValueError("x"))
    assert os.listdir(tmp_path) == []


def ok() -> int:
    return 1


#: A function pickle cannot find by name (a local one is an AttributeError in torch on 3.11).
A_LAMBDA = lambda: 1  # noqa: E731


def torch_start(args: dict[int, tuple[object, ...]], envs: Any, log_dir: str, **kw: Any) -> Any:
    return torch_mp.start_processes(
        "w", kw.pop("entrypoint", ok), args, envs, torch_mp.DefaultLogsSpecs(log_dir), **kw
    )


def relaunch_start(args: dict[int, tuple[object, ...]], envs: Any, log_dir: str, **kw: Any) -> Any:
    return relaunch_start_processes("w", kw.pop("entrypoint", ok), args, envs, log_dir, **kw)


def raised(start: Callable[..., Any], *args: Any, **kw: Any) -> BaseException:
    with pytest.raises(Exception) as caught:
        context = start(*args, **kw)
        context.close()  # not reached: each call below is refused before anything starts
    return caught.value


@pytest.mark.timeout(60)
def test_start_processes_argument_errors_are_torchs_types(tmp_path, leaks: LeakCheck) -> None:
    envs = leaks.envs(2)
    not_executable = str(tmp_path / "job.sh")
    with open(not_executable, "w") as file:
        file.write("#!/bin/sh\n")

    cases: dict[str, tuple[tuple[Any, ...], dict[str, Any], tuple[type[BaseException], ...]]] = {
        "args and envs disagree": (({0: (), 1: ()}, {0: envs[0]}), {}, (RuntimeError,)),
        "an unknown start method": (({0: ()}, {0: envs[0]}), {"start_method": "nope"}, ()),
        "a binary that is missing": (
            ({0: ()}, {0: envs[0]}),
            {"entrypoint": str(tmp_path / "missing")},
            (FileNotFoundError,),
        ),
        "a binary not on PATH": (
            ({0: ()}, {0: envs[0]}),
            {"entrypoint": "relaunch-no-such-binary"},
            (FileNotFoundError,),
        ),
        "a binary not executable": (
            ({0: ()}, {0: envs[0]}),
            {"entrypoint": not_executable},
            (PermissionError,),
        ),
        "a lambda under spawn": (
            ({0: ()}, {0: envs[0]}),
            {"entrypoint": A_LAMBDA, "start_method": "spawn"},
            (pickle.PicklingError,),
        ),
    }
    for what, (args, kw, expected) in cases.items():
        theirs = raised(torch_start, *args, str(tmp_path / f"t-{len(os.listdir(tmp_path))}"), **kw)
        log_dir = tmp_path / f"r-{len(os.listdir(tmp_path))}"
        log_dir.mkdir()
        mine = raised(relaunch_start, *args, str(log_dir), **kw)
        assert isinstance(mine, type(theirs)), (what, mine, theirs)
        assert all(isinstance(mine, cls) for cls in expected), (what, mine)
        # and what relaunch raised before, for code written against relaunch
        assert isinstance(mine, (ValueError, FileNotFoundError)), (what, mine)


def test_a_log_dir_that_is_a_file_is_not_a_directory_in_both(tmp_path, leaks: LeakCheck) -> None:
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(NotADirectoryError):
        torch_mp.DefaultLogsSpecs(str(path))
    with pytest.raises(NotADirectoryError) as caught:
        relaunch_start_processes("w", ok, {0: ()}, leaks.envs(1), str(path))
    assert isinstance(caught.value, ValueError)  # what relaunch raised before: still caught
    assert "is a file" in str(caught.value)
