"""The size bounds of the code (issue 44): no module of relaunch over 500 lines, and at most 5
functions over 60 lines, so that a module stays one concern and a function one step."""

from __future__ import annotations

import ast
import pathlib

import relaunch

SRC = pathlib.Path(relaunch.__file__).parent
MAX_MODULE_LINES = 500
LONG_FUNCTION = 60
MAX_LONG_FUNCTIONS = 5


def _modules() -> list[pathlib.Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_module_is_over_500_lines() -> None:
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in _modules()}
    assert len(sizes) > 100
    too_big = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_big, f"split these along a real seam: {too_big}"


def test_at_most_5_functions_are_over_60_lines() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LONG_FUNCTION:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines})")
    assert len(long) <= MAX_LONG_FUNCTIONS, f"over {LONG_FUNCTION} lines: {long}"
