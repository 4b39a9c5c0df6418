"""The public API is a contract: its names are pinned here, and importing it stays light."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import relaunch

CORE = pathlib.Path(relaunch.__file__).parent / "core"
FORBIDDEN_IN_CORE = {"os", "subprocess", "socket", "threading", "time", "select", "selectors"}


def test_public_names_are_pinned() -> None:
    assert sorted(relaunch.__all__) == [
        "ChildFailedError",
        "LaunchConfig",
        "LocalElasticAgent",
        "MultiprocessContext",
        "PContext",
        "ProcessFailure",
        "RunProcsResult",
        "RunResult",
        "SignalException",
        "StateError",
        "Std",
        "SubprocessContext",
        "TailLog",
        "Worker",
        "WorkerGroup",
        "WorkerSpec",
        "WorkerState",
        "elastic_launch",
        "failure_pending",
        "heartbeat",
        "load_state",
        "on_failure_pending",
        "record",
        "report_progress",
        "restart_in_place",
        "resumes_from",
        "save_state",
        "section",
        "start_processes",
        "stop_requested",
    ]
    for name in relaunch.__all__:
        assert getattr(relaunch, name) is not None


def test_type_checkers_see_the_public_names() -> None:
    """What ``__init__`` imports for type checkers re-exports each public name from its home."""
    tree = ast.parse(pathlib.Path(relaunch.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    seen = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    assert seen == relaunch._HOMES


def test_timer_names_are_the_seeds() -> None:
    import relaunch.timer

    assert sorted(relaunch.timer.__all__) == [
        "FileTimerClient",
        "FileTimerRequest",
        "FileTimerServer",
        "LocalTimerClient",
        "LocalTimerServer",
        "RequestQueue",
        "TimerClient",
        "TimerRequest",
        "TimerServer",
        "configure",
        "expires",
        "log_debug_info_for_expired_timers",
    ]


def test_a_single_node_launch_loads_no_timer_etcd_or_network_code() -> None:
    code = (
        "import sys, relaunch.cli, relaunch.launcher, relaunch.agent; "
        "print(sorted({'relaunch.timer', 'relaunch.store.etcd', 'http.client', 'ssl', "
        "'socket', '_hashlib'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_core_is_pure() -> None:
    for path in CORE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & FORBIDDEN_IN_CORE, f"{path.name} imports {names & FORBIDDEN_IN_CORE}"


def test_import_pulls_in_no_framework() -> None:
    code = (
        "import sys, relaunch, relaunch.cli; "
        "heavy = {'torch', 'numpy', 'jax', 'asyncio', 'ctypes'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
