"""relaunch: a fast, lean, orphan-proof, torchrun-compatible launcher for distributed jobs.

The public names follow ``torch.distributed.elastic``, so code moves over by changing an import.
Importing relaunch never imports torch or any other framework.

The names load on first use (PEP 562): a worker that only calls ``relaunch.report_progress``,
``relaunch.stop_requested``, ``relaunch.heartbeat`` or ``relaunch.section`` pays for the channel
module, one that calls ``relaunch.save_state``/``load_state`` for the state's, not for the agent
and its processes.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: Every public name, by the module that defines it: imported when the name is first asked for.
#: The one list of the public API: ``__all__`` is its names.
_HOMES = {
    name: module
    for module, names in {
        "relaunch.agent": (
            "LocalElasticAgent",
            "RunResult",
            "Worker",
            "WorkerGroup",
            "WorkerSpec",
            "WorkerState",
        ),
        "relaunch.launcher": ("LaunchConfig", "elastic_launch"),
        "relaunch.procs": (
            "ChildFailedError",
            "MultiprocessContext",
            "PContext",
            "ProcessFailure",
            "RunProcsResult",
            "SignalException",
            "Std",
            "SubprocessContext",
            "TailLog",
            "record",
            "start_processes",
        ),
        "relaunch.in_place": ("restart_in_place", "resumes_from"),
        "relaunch.state.api": ("StateError", "load_state", "save_state"),
        "relaunch.worker": (
            "failure_pending",
            "heartbeat",
            "on_failure_pending",
            "report_progress",
            "section",
            "stop_requested",
        ),
    }.items()
    for name in names
}

__all__ = sorted(_HOMES)

# What type checkers see: the same names (tests/unit/test_api.py checks), each re-exported
# explicitly (``X as X``), as a computed ``__all__`` is lost on them. They read any name
# TYPE_CHECKING as true; not ``typing.TYPE_CHECKING``: importing typing costs a worker
# milliseconds.
TYPE_CHECKING = False
if TYPE_CHECKING:
    # isort: off
    from relaunch.agent import (
        LocalElasticAgent as LocalElasticAgent,
        RunResult as RunResult,
        Worker as Worker,
        WorkerGroup as WorkerGroup,
        WorkerSpec as WorkerSpec,
        WorkerState as WorkerState,
    )
    from relaunch.launcher import LaunchConfig as LaunchConfig, elastic_launch as elastic_launch
    from relaunch.procs import (
        ChildFailedError as ChildFailedError,
        MultiprocessContext as MultiprocessContext,
        PContext as PContext,
        ProcessFailure as ProcessFailure,
        RunProcsResult as RunProcsResult,
        SignalException as SignalException,
        Std as Std,
        SubprocessContext as SubprocessContext,
        TailLog as TailLog,
        record as record,
        start_processes as start_processes,
    )
    from relaunch.in_place import (
        restart_in_place as restart_in_place,
        resumes_from as resumes_from,
    )
    from relaunch.state.api import (
        StateError as StateError,
        load_state as load_state,
        save_state as save_state,
    )
    from relaunch.worker import (
        failure_pending as failure_pending,
        heartbeat as heartbeat,
        on_failure_pending as on_failure_pending,
        report_progress as report_progress,
        section as section,
        stop_requested as stop_requested,
    )
    # isort: on


def __getattr__(name: str) -> object:
    """A public name, or a submodule (``relaunch.procs``), imported on first use and kept."""
    import importlib

    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The loaded names and every public one, loaded or not."""
    return sorted({*globals(), *__all__})
