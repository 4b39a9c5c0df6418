"""``--run-path``: run a Python script inside a function worker, as ``python script.py`` would."""

from __future__ import annotations

import runpy
import sys


def run_script(script: str, *args: str) -> None:
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
