"""``@record`` scenarios for tests/compat/test_compat_errors.py, run in a fresh process under
torch's errors module or relaunch's (``record`` enables faulthandler, which a test process should
keep as pytest set it).

Usage: ``python compat_errors_fns.py torch|relaunch DIR``. Each scenario gets its own
``TORCHELASTIC_ERROR_FILE`` under ``DIR``; the last line of stdout is JSON: for each scenario, how
the decorated call ended and what the error file holds (None: no file).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

#: A child's error file in the layout @record writes (the root cause a launcher passes up).
CHILD_RECORD = {
    "message": {
        "message": "RuntimeError: the child failed",
        "extraInfo": {
            "py_callstack": "Traceback ...\nRuntimeError: the child failed\n",
            "timestamp": "1700000000",
        },
    }
}
#: A child's error file with a text message (torch leaves its error code alone).
CHILD_TEXT = {"message": "the child failed", "timestamp": 1700000001}


def scenarios(errors: Any, directory: str) -> dict[str, Callable[[], object]]:
    """The functions to decorate, by name; they use ``errors``' own exception types."""

    def child_file(name: str, data: object) -> str:
        path = os.path.join(directory, f"child-{name}.json")
        with open(path, "w") as file:
            json.dump(data, file)
        return path

    def launcher(exitcode: int, error_file: str) -> Callable[[], object]:
        def run() -> object:
            failure = errors.ProcessFailure(0, 4242, exitcode, error_file)
            raise errors.ChildFailedError("trainer", {3: failure})

        return run

    def raises() -> object:
        raise ValueError("boom")

    def exits(code: object) -> Callable[[], object]:
        def run() -> object:
            sys.exit(code)

        return run

    return {
        "raises": raises,
        "returns": lambda: 7,
        "exit_0": exits(0),
        "exit_none": exits(None),
        "exit_3": exits(3),
        "child_without_error_file": launcher(1, os.path.join(directory, "missing.json")),
        "child_record_exit_1": launcher(1, child_file("record1", CHILD_RECORD)),
        "child_record_sigsegv": launcher(-11, child_file("record11", CHILD_RECORD)),
        "child_text_exit_2": launcher(2, child_file("text", CHILD_TEXT)),
        "child_record_over_a_stale_file": launcher(1, child_file("record_stale", CHILD_RECORD)),
    }


#: Scenarios whose error file already holds something (a stale file, not JSON).
STALE = ("child_record_over_a_stale_file",)


def main(impl: str, directory: str) -> None:
    if impl == "torch":
        from torch.distributed.elastic.multiprocessing import errors
    else:
        from relaunch.procs import errors  # type: ignore[no-redef]
    results: dict[str, dict[str, object]] = {}
    for name, function in scenarios(errors, directory).items():
        path = os.path.join(directory, f"{impl}-{name}.json")
        os.environ["TORCHELASTIC_ERROR_FILE"] = path
        if name in STALE:
            with open(path, "w") as file:
                file.write("stale, not JSON")
        try:
            outcome = f"returned {function_result(errors.record(function))!r}"
        except BaseException as exc:  # SystemExit included: the outcome is what is compared
            outcome = f"raised {type(exc).__name__}"
        data = None
        if os.path.exists(path):
            with open(path) as file:
                data = json.load(file)
        results[name] = {"outcome": outcome, "file": data}
    print(json.dumps(results))


def function_result(decorated: Callable[[], object]) -> object:
    return decorated()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
