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
        "Std",
        "SubprocessContext",
        "TailLog",
        "Worker",
        "WorkerGroup",
        "WorkerSpec",
        "WorkerState",
        "elastic_launch",
        "record",
        "start_processes",
    ]
    for name in relaunch.__all__:
        assert getattr(relaunch, name) is not None


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
