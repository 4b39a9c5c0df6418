"""relaunch: a fast, lean, orphan-proof, torchrun-compatible launcher for distributed jobs.

The public names follow ``torch.distributed.elastic``, so code moves over by changing an import.
Importing relaunch never imports torch or any other framework.

The names load on first use (PEP 562): a worker that only calls ``relaunch.report_progress``,
``relaunch.stop_requested``, ``relaunch.heartbeat`` or ``relaunch.section`` pays for the channel
module, not for the agent and its processes.
"""

from __future__ import annotations

# Not ``typing.TYPE_CHECKING``: importing typing would cost a worker milliseconds. Type checkers
# read any name TYPE_CHECKING as true, so they still see every public name below.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from relaunch.agent import (
        LocalElasticAgent,
        RunResult,
        Worker,
        WorkerGroup,
        WorkerSpec,
        WorkerState,
    )
    from relaunch.launcher import LaunchConfig, elastic_launch
    from relaunch.procs import (
        ChildFailedError,
        MultiprocessContext,
        PContext,
        ProcessFailure,
        RunProcsResult,
        SignalException,
        Std,
        SubprocessContext,
        TailLog,
        record,
        start_processes,
    )
    from relaunch.worker import heartbeat, report_progress, section, stop_requested

__version__ = "0.1.0"

__all__ = [
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
    "heartbeat",
    "record",
    "report_progress",
    "section",
    "start_processes",
    "stop_requested",
]

#: Where each public name is defined: the module imported when the name is first asked for.
_HOMES = {
    **dict.fromkeys(
        [
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
        ],
        "relaunch.procs",
    ),
    **dict.fromkeys(
        ["LocalElasticAgent", "RunResult", "Worker", "WorkerGroup", "WorkerSpec", "WorkerState"],
        "relaunch.agent",
    ),
    "LaunchConfig": "relaunch.launcher",
    "elastic_launch": "relaunch.launcher",
    **dict.fromkeys(
        ["heartbeat", "report_progress", "section", "stop_requested"], "relaunch.worker"
    ),
}


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
