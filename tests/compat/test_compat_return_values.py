"""A function worker's return value through relaunch, beside torch 2.13 as the reference.

Any value the standard pickler can send arrives as torch's launcher gives it (tensors, a dict of
them with views and several dtypes, a large tensor, None, a plain object, a numpy array), through
``start_processes`` and through ``elastic_launch``. relaunch reads the value after the worker
exited, so it is sent by value (``relaunch.procs.returns``), not by torch's fd-sharing
reduction. A value that cannot be sent (in the worker) or loaded (in the launcher) fails its rank
with one clear message in its error file: no dead thread, no hang, no process left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import compat_returns_fns as fns
import pytest
from conftest import (
    MARK_VAR,
    LeakCheck,
    _helpers_of_this_process,
    pid_alive,
    signal_handlers_kept,
    wait_until,
)

from relaunch import LaunchConfig, elastic_launch
from relaunch.procs import ChildFailedError
from relaunch.procs import start_processes as relaunch_start_processes
from relaunch.procs.base import PContext
from relaunch.procs.monitor import GroupMonitor
from relaunch.procs.returns import ReturnReader, ReturnValueError, send_return_value

pytestmark = pytest.mark.xdist_group("torch")

torch = pytest.importorskip("torch")
torch_mp = pytest.importorskip("torch.distributed.elastic.multiprocessing")
torch_launcher = pytest.importorskip("torch.distributed.launcher.api")

HERE = os.path.dirname(os.path.abspath(__file__))
#: A large value, in MiB per rank.
LARGE_MIB = 32


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch, leaks: LeakCheck) -> LeakCheck:
    """Workers spawned from this process carry the leak mark (a function worker's own
    environment is set after it started, where the leak check cannot see it)."""
    monkeypatch.setenv(MARK_VAR, leaks.mark)
    return leaks


def envs(nprocs: int) -> dict[int, dict[str, str]]:
    return {rank: {"LOCAL_RANK": str(rank)} for rank in range(nprocs)}


def run_torch(tmp_path: Any, fn: Callable[..., Any], args: tuple[Any, ...], n: int = 2) -> Any:
    """torch's start_processes: the finished result."""
    specs = torch_mp.DefaultLogsSpecs(log_dir=str(tmp_path / "torch"))
    pc = torch_mp.start_processes(
        "t", fn, dict.fromkeys(range(n), args), envs(n), specs, start_method="spawn"
    )
    try:
        result = None
        while result is None:
            result = pc.wait(timeout=1)
        return result
    finally:
        pc.close()


def run_relaunch(tmp_path: Any, fn: Callable[..., Any], args: tuple[Any, ...], n: int = 2) -> Any:
    """relaunch's start_processes: the finished result; its workers are gone after."""
    log_dir = tmp_path / "relaunch"
    log_dir.mkdir()
    pc = relaunch_start_processes(
        "t", fn, dict.fromkeys(range(n), args), envs(n), str(log_dir), start_method="spawn"
    )
    pids = pc.pids()
    try:
        result = pc.wait(timeout=60)
    finally:
        pc.close()
    assert result is not None, "the workers did not end within 60 s"
    assert not [pid for pid in pids.values() if pid_alive(pid)]
    return result


def same_value(mine: Any, theirs: Any) -> None:
    """``mine`` equals ``theirs`` in type, dtype, shape, strides and content, recursively."""
    assert type(mine) is type(theirs)
    if isinstance(theirs, torch.Tensor):
        assert (mine.dtype, mine.shape, mine.stride(), mine.requires_grad) == (
            theirs.dtype,
            theirs.shape,
            theirs.stride(),
            theirs.requires_grad,
        )
        assert torch.equal(mine, theirs)
    elif isinstance(theirs, dict):
        assert list(mine) == list(theirs)
        for key in theirs:
            same_value(mine[key], theirs[key])
    elif type(theirs).__module__ == "numpy":
        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape)
        assert (mine == theirs).all()
    else:
        assert mine == theirs


VALUES: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "tensor": (fns.tensor, ()),
    "dict-of-tensors": (fns.tensor_dict, ()),
    "none": (fns.nothing, ()),
    "plain-object": (fns.plain_object, ()),
    "numpy-array": (fns.numpy_array, ()),
    "large-tensor": (fns.large_tensor, (LARGE_MIB,)),
}


def reference(make: Callable[[], dict[int, Any]]) -> dict[int, Any]:
    """torch's values by rank, each ``{kind: value}``: every kind's reference in one run of
    torch's launcher (``fns.several``), its workers marked and checked gone and the signal
    handlers it sets put back, like a test's."""
    leaks = LeakCheck()
    with pytest.MonkeyPatch.context() as patch, signal_handlers_kept():
        patch.setenv(MARK_VAR, leaks.mark)
        started = time.monotonic()
        values = make()
        print(f"torch, every kind: {time.monotonic() - started:.2f}s")
    left = leaks.collect(5.0, keep=_helpers_of_this_process())
    assert not left, "processes left behind (killed): " + "; ".join(left)
    assert sorted(values) == [0, 1]
    return values


@pytest.fixture(scope="module")
def torch_returns(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """What torch's start_processes returns for every kind of VALUES."""

    def make() -> dict[int, Any]:
        result = run_torch(tmp_path_factory.mktemp("reference"), fns.several, (VALUES,))
        assert not result.is_failed()
        return result.return_values

    return reference(make)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(VALUES))
def test_start_processes_returns_what_torch_returns(
    kind: str, tmp_path, marked, torch_returns
) -> None:
    fn, args = VALUES[kind]
    started = time.monotonic()
    mine = run_relaunch(tmp_path, fn, args)
    print(f"{kind}: relaunch {time.monotonic() - started:.2f}s")
    assert not mine.is_failed()
    assert sorted(mine.return_values) == [0, 1]
    for rank in (0, 1):
        same_value(mine.return_values[rank], torch_returns[rank][kind])


def test_views_of_one_storage_still_share_it(tmp_path, marked) -> None:
    """A view and its base arrive sharing one storage, as within one torch.save (the worker
    is forked: the value is sent the same way, and the fork imports no torch of its own)."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pc = relaunch_start_processes(
        "t", fns.tensor_dict, {0: ()}, envs(1), str(log_dir), start_method="fork"
    )
    try:
        result = pc.wait(timeout=60)
    finally:
        pc.close()
    assert result is not None and not result.is_failed()
    value = result.return_values[0]
    value["weight"][1, 0] = 100.0
    assert value["row"][0].item() == 100.0 and value["transposed"][0, 1].item() == 100.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_other_start_methods_return_the_same_values(start_method: str, tmp_path, marked) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pc = relaunch_start_processes(
        "t", fns.tensor_dict, {0: (), 1: ()}, envs(2), str(log_dir), start_method=start_method
    )
    try:
        result = pc.wait(timeout=60)
    finally:
        pc.close()
    assert result is not None and not result.is_failed()
    for rank in (0, 1):
        os.environ["LOCAL_RANK"] = str(rank)
        try:
            same_value(result.return_values[rank], fns.tensor_dict())
        finally:
            del os.environ["LOCAL_RANK"]


def frame_of(value: object) -> bytes:
    """The bytes a worker writes for ``value``."""
    read_end, write_end = os.pipe()

    def send() -> None:
        try:
            send_return_value(write_end, value, "f")
        finally:
            os.close(write_end)

    sender = threading.Thread(target=send)
    sender.start()
    with os.fdopen(read_end, "rb") as reader:
        data = reader.read()
    sender.join()
    return data


def reader_of(data: bytes) -> ReturnReader:
    """A reader that has read ``data``, then the pipe's end."""
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    reader = ReturnReader(read_end)
    assert reader.read(1 << 20)
    reader.close()
    return reader


def test_a_frame_cut_short_is_a_clear_error_not_a_value() -> None:
    """A worker that dies while it sends leaves part of a frame: that is no value."""
    whole = frame_of(list(range(10_000)))
    assert reader_of(whole).load("local rank 0") == list(range(10_000))
    with pytest.raises(ReturnValueError, match=r"local rank 0's return value arrived incomplete"):
        reader_of(whole[: len(whole) // 2]).load("local rank 0")
    with pytest.raises(ReturnValueError, match="arrived incomplete"):
        reader_of(b"not a frame at all").load("local rank 0")
    assert reader_of(b"").load("local rank 0") is None  # it sent nothing


def test_a_large_value_is_read_as_it_arrives() -> None:
    """The reader takes what is in the pipe and leaves the rest for later (no blocking read),
    in steps of at most its limit."""
    big = b"x" * (8 << 20)
    frame = frame_of(big)
    read_end, write_end = os.pipe()
    reader = ReturnReader(read_end)
    try:
        os.set_blocking(write_end, False)
        sent = 0
        steps = 0
        while not reader.done:
            try:
                sent += os.write(write_end, frame[sent:])
            except BlockingIOError:
                pass
            before = reader.received
            reader.read(1 << 16)
            assert reader.received - before <= (1 << 16) + 64
            steps += 1
        assert sent == len(frame) and steps > 2
        assert reader.load("x") == big
    finally:
        reader.close()
        os.close(write_end)


def launch_config(run_id: str, **overrides: Any) -> dict[str, Any]:
    return {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": 2,
        "rdzv_backend": "c10d",
        "rdzv_endpoint": "127.0.0.1:0",
        "run_id": run_id,
        "max_restarts": 0,
        "monitor_interval": 0.1,
        **overrides,
    }


LAUNCHED = ["tensor", "dict-of-tensors", "large-tensor", "none"]


@pytest.fixture(scope="module")
def torch_launch_returns() -> dict[int, Any]:
    """What torch's elastic_launch returns for every kind of LAUNCHED."""
    calls = {kind: VALUES[kind] for kind in LAUNCHED}
    config = torch_launcher.LaunchConfig(**launch_config("torch-reference"))
    return reference(lambda: torch_launcher.elastic_launch(config, fns.several)(calls))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", LAUNCHED)
def test_elastic_launch_returns_what_torch_returns(kind: str, marked, torch_launch_returns) -> None:
    """The issue's case: ``elastic_launch(config, trainer)()`` with a trainer that returns a
    tensor hung under relaunch (the monitor thread died unpickling it)."""
    fn, args = VALUES[kind]
    started = time.monotonic()
    mine = elastic_launch(LaunchConfig(**launch_config(f"relaunch-{kind}")), fn)(*args)
    print(f"{kind}: relaunch {time.monotonic() - started:.2f}s")
    assert sorted(mine) == [0, 1]
    for rank in (0, 1):
        same_value(mine[rank], torch_launch_returns[rank][kind])


# -- values that cannot arrive: one clear failure, no hang, nothing left ------------------------

CANNOT_SEND = {
    "lambda": (fns.a_lambda, "function"),
    "generator": (fns.a_generator, "generator"),
    "socket": (fns.a_socket, "socket.socket"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(CANNOT_SEND))
def test_a_value_that_cannot_be_sent_fails_its_rank_clearly(kind: str, tmp_path, marked) -> None:
    fn, type_name = CANNOT_SEND[kind]
    result = run_relaunch(tmp_path, fn, (), n=1)
    assert result.is_failed() and result.return_values == {}
    failure = result.failures[0]
    assert failure.exitcode == 1
    said = failure.error_file_data["message"]["message"]
    assert f"returned a {type_name}, which cannot be sent to the launcher" in said
    assert "return plain data" in said
    assert os.path.isfile(failure.error_file)


CANNOT_LOAD = {
    "worker-only-type": (
        fns.worker_only_type,
        f"returned a {fns.WORKER_ONLY_MODULE}.Secret the launcher cannot load: "
        f"ModuleNotFoundError: No module named '{fns.WORKER_ONLY_MODULE}'",
    ),
    "failing-setstate": (
        fns.refuses_to_load,
        "returned a compat_returns_fns.RefusesToLoad the launcher cannot load: "
        "RuntimeError: RefusesToLoad will not be unpickled",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(CANNOT_LOAD))
def test_a_value_the_launcher_cannot_load_fails_its_rank_clearly(
    kind: str, tmp_path, marked
) -> None:
    fn, expected = CANNOT_LOAD[kind]
    result = run_relaunch(tmp_path, fn, (), n=2)
    assert result.is_failed() and result.return_values == {}
    assert sorted(result.failures) == [0, 1]
    for rank, failure in result.failures.items():
        assert failure.exitcode == 0  # the worker itself succeeded
        said = failure.error_file_data["message"]["message"]
        assert said.startswith(f"ReturnValueError: local rank {rank} {expected}")
        assert said.endswith("; return plain data or a type importable in the launcher")
        assert os.path.isfile(failure.error_file)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["failing-setstate", "lambda"])
def test_elastic_launch_ends_with_child_failed_error(kind: str, marked) -> None:
    fn = {**{k: v[0] for k, v in CANNOT_LOAD.items()}, **{k: v[0] for k, v in CANNOT_SEND.items()}}
    config = LaunchConfig(**launch_config(f"fail-{kind}"))
    with pytest.raises(ChildFailedError) as caught:
        elastic_launch(config, fn[kind])()
    report = str(caught.value)
    if kind == "lambda":
        assert "returned a function, which cannot be sent to the launcher" in report
    else:
        assert "rank 0 returned a compat_returns_fns.RefusesToLoad the launcher cannot" in report


# -- the monitor thread: whatever raises in it, wait() and close() return -----------------------


@pytest.mark.timeout(60)
def test_wait_returns_a_failure_when_the_result_cannot_be_built(
    tmp_path, marked, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the monitor thread died building the result, and wait() returned None (still
    running) forever."""

    def broken(self: PContext) -> None:
        raise RuntimeError("injected: no result")

    monkeypatch.setattr(PContext, "_build_result", broken)
    result = run_relaunch(tmp_path, fns.nothing, (), n=2)
    assert sorted(result.failures) == [0, 1]
    assert "relaunch's worker monitor failed (RuntimeError: injected: no result)" in (
        result.failures[0].message
    )


@pytest.mark.timeout(60)
def test_a_monitor_that_fails_while_workers_run_kills_them_and_ends_the_group(
    tmp_path, marked, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The monitor fails while both workers still run: wait() returns a failure, close()
    returns, and both workers are gone."""
    failing = {"now": False}
    original = GroupMonitor._past_deadlines

    def injected(self: GroupMonitor) -> bool:
        if failing["now"]:
            raise RuntimeError("injected monitor fault")
        return original(self)

    monkeypatch.setattr(GroupMonitor, "_past_deadlines", injected)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pc = relaunch_start_processes(
        "t", fns.sleep_then_return, {0: (300,), 1: (300,)}, envs(2), str(log_dir)
    )
    pids = pc.pids()
    try:
        failing["now"] = True
        pc._monitor._wake()  # type: ignore[union-attr]
        result = pc.wait(timeout=30)
    finally:
        pc.close()
    assert result is not None and sorted(result.failures) == [0, 1]
    assert all(code == -signal.SIGKILL for code in result.exitcodes.values())
    assert not [pid for pid in pids.values() if pid_alive(pid)]


@pytest.fixture
def launcher_script(tmp_path) -> Iterator[str]:
    path = tmp_path / "launch.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {HERE!r})
            import compat_returns_fns as fns
            from relaunch import LaunchConfig, elastic_launch
            if __name__ == "__main__":
                config = LaunchConfig(
                    min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                    rdzv_endpoint="127.0.0.1:0", run_id="sub", max_restarts=0,
                    monitor_interval=0.1,
                )
                fn, args = getattr(fns, sys.argv[1]), tuple(map(float, sys.argv[2:]))
                print("values:", elastic_launch(config, fn)(*args), flush=True)
            """
        )
    )
    yield str(path)


@pytest.mark.timeout(90)
def test_the_issue_repro_returns_the_tensors(launcher_script: str, leaks: LeakCheck) -> None:
    """The issue's script, as a user runs it: it prints both ranks' tensors and exits 0."""
    out = subprocess.run(
        [sys.executable, launcher_script, "tensor"],
        capture_output=True,
        text=True,
        timeout=60,
        env=leaks.process_env(),
    )
    assert out.returncode == 0, out.stderr
    assert "values: {0: tensor([1., 1.]), 1: tensor([2., 2.])}" in out.stdout


@pytest.mark.timeout(90)
def test_the_first_sigterm_ends_the_launch(
    launcher_script: str, leaks: LeakCheck, tmp_path
) -> None:
    """One SIGTERM while the workers run ends the launcher and its workers (the issue saw a
    launch the first SIGTERM did not end); the leak check proves the workers gone."""
    announced = tmp_path / "up"
    announced.mkdir()
    proc = subprocess.Popen(
        [sys.executable, launcher_script, "announce_and_sleep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=leaks.process_env(ANNOUNCE_DIR=str(announced)),
    )
    try:
        wait_until(lambda: len(os.listdir(announced)) == 2, 60, "both workers to start")
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, err = proc.communicate(timeout=45)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, err
    assert took < 15, f"the launcher took {took:.1f}s to end after SIGTERM"
    assert not [pid for pid in map(int, os.listdir(announced)) if pid_alive(pid)]
