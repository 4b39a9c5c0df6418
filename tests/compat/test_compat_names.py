"""torch 2.13's public names at relaunch's mirrored paths (docs/python-api.md, "Moving from
torch"): the import of a torch program changes by a sed of the module prefix, and each name it
imports is there and takes torch's parameters. torch is introspected at test time; what is
not at the mirror, or takes parameters differently, is listed here with the reason."""

from __future__ import annotations

import abc
import importlib
import inspect
import subprocess
import sys
from typing import Any, Generic

import pytest

pytestmark = pytest.mark.xdist_group("torch")

torch = pytest.importorskip("torch")
if not torch.__version__.startswith("2.13"):
    pytest.skip(f"pinned against torch 2.13, not {torch.__version__}", allow_module_level=True)

#: torch's module -> relaunch's module at the mirrored path.
MIRRORS = {
    "torch.distributed.elastic.multiprocessing": "relaunch.multiprocessing",
    "torch.distributed.elastic.multiprocessing.api": "relaunch.multiprocessing.api",
    "torch.distributed.elastic.multiprocessing.errors": "relaunch.multiprocessing.errors",
    "torch.distributed.elastic.multiprocessing.errors.error_handler": (
        "relaunch.multiprocessing.errors.error_handler"
    ),
    "torch.distributed.elastic.multiprocessing.errors.handlers": (
        "relaunch.multiprocessing.errors.handlers"
    ),
    "torch.distributed.elastic.multiprocessing.tail_log": "relaunch.multiprocessing.tail_log",
    "torch.distributed.elastic.rendezvous": "relaunch.rendezvous",
    "torch.distributed.elastic.rendezvous.api": "relaunch.rendezvous.api",
    "torch.distributed.elastic.rendezvous.registry": "relaunch.rendezvous.registry",
    "torch.distributed.elastic.rendezvous.utils": "relaunch.rendezvous.utils",
    "torch.distributed.elastic.agent.server": "relaunch.agent",
    "torch.distributed.elastic.agent.server.api": "relaunch.agent.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent": (
        "relaunch.agent.local_elastic_agent"
    ),
    "torch.distributed.elastic.timer": "relaunch.timer",
    "torch.distributed.elastic.timer.api": "relaunch.timer.api",
    "torch.distributed.elastic.timer.local_timer": "relaunch.timer.local_timer",
    "torch.distributed.elastic.timer.file_based_local_timer": (
        "relaunch.timer.file_based_local_timer"
    ),
    "torch.distributed.elastic.timer.debug_info_logging": "relaunch.timer.debug_info_logging",
    "torch.distributed.elastic.events": "relaunch.events",
    "torch.distributed.elastic.events.api": "relaunch.events.api",
    "torch.distributed.elastic.events.handlers": "relaunch.events.handlers",
    "torch.distributed.launcher": "relaunch.launcher",
    "torch.distributed.launcher.api": "relaunch.launcher",
}

#: torch's public names that are not at the mirror, and why (docs/python-api.md says it too).
NOT_AT_MIRROR = {
    ("torch.distributed.elastic.multiprocessing.api", "get_std_cm"): "torch's stdout redirect",
    ("torch.distributed.elastic.agent.server", "SimpleElasticAgent"): "agent is core.step",
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent"): "agent is core.step",
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "TORCHELASTIC_HEALTH_CHECK_PORT",
    ): "no health check server (torch's is a stub)",
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT",
    ): "no D-state watchdog: teardown is bounded by the guardian",
}

#: Built by start_processes (whose torch and seeds' forms are both taken): their constructors
#: take relaunch's arguments, and only their methods are checked.
BUILT_BY_START_PROCESSES = ("MultiprocessContext", "PContext", "SubprocessContext")

#: Callables built with keywords past their first few parameters (torch's docs do): only those
#: few are checked for their position. WorkerSpec takes all of torch's in torch's order
#: (relaunch's own fields come after them).
POSITIONAL = {"LaunchConfig": 3}

#: What relaunch's callables do not take as torch's do (a parameter or method missing, a
#: required one torch defaults, another position), by name, each with its reason; the same in
#: docs/python-api.md.
KNOWN_GAPS: dict[str, list[str]] = {
    # relaunch's failure report has its own layout: no delimiters to choose.
    "ChildFailedError": [
        ".format_msg(boarder_delim: missing)",
        ".format_msg(section_delim: missing)",
    ],
    # torch's test hook: process the queued requests once, then stop.
    "FileTimerServer": [".run_once: missing"],
}


def public_names(module: Any) -> list[str]:
    """``__all__``, or for a module without one the classes, functions and upper-case constants
    it defines (a package: also those it re-exports from torch.distributed.elastic)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.ismodule(value):
            continue
        if inspect.isclass(value) or inspect.isfunction(value):
            home = value.__module__
            if home == module.__name__ or (
                hasattr(module, "__path__") and home.startswith("torch.distributed.elastic")
            ):
                names.append(name)
        elif isinstance(value, (str, int)) and name.isupper():
            names.append(name)
    return names


def parameter_gaps(theirs: Any, mine: Any, positional: int | None = None) -> list[str]:
    """Each way ``mine`` does not take a call written for ``theirs`` (the positions of the
    first ``positional`` parameters only, when given)."""
    try:
        their_params = list(inspect.signature(theirs).parameters.values())
        my_params = list(inspect.signature(mine).parameters.values())
    except (TypeError, ValueError):
        return []
    index = {p.name: i for i, p in enumerate(my_params)}
    takes_keywords = any(p.kind is p.VAR_KEYWORD for p in my_params)
    gaps = []
    for position, param in enumerate(their_params):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            if not any(p.kind is param.kind for p in my_params):
                gaps.append(f"*{param.name}")
            continue
        if param.name not in index:
            if not takes_keywords:
                gaps.append(f"{param.name}: missing")
            continue
        my_param = my_params[index[param.name]]
        checks_position = positional is None or position < positional
        if (
            checks_position
            and param.kind is not param.KEYWORD_ONLY
            and (my_param.kind is my_param.KEYWORD_ONLY or index[param.name] != position)
        ):
            gaps.append(f"{param.name}: at {index[param.name]}, not {position}")
        if param.default is not param.empty and my_param.default is my_param.empty:
            gaps.append(f"{param.name}: required")
    return gaps


def api_gaps(theirs: Any, mine: Any) -> list[str]:
    """``parameter_gaps`` of a function, or of a class's constructor and public methods."""
    if not inspect.isclass(theirs):
        return parameter_gaps(theirs, mine) if callable(theirs) else []
    gaps = (
        []
        if issubclass(theirs, BaseException) or theirs.__name__ in BUILT_BY_START_PROCESSES
        else parameter_gaps(theirs, mine, POSITIONAL.get(theirs.__name__))
    )
    for name, member in vars(theirs).items():
        if name.startswith("_") or not callable(member) or isinstance(member, type):
            continue
        if not hasattr(mine, name):
            gaps.append(f".{name}: missing")
        else:
            gaps += [f".{name}({gap})" for gap in parameter_gaps(member, getattr(mine, name))]
    return gaps


def mirrored_names() -> list[tuple[str, str]]:
    return [
        (module, name)
        for module in MIRRORS
        for name in public_names(importlib.import_module(module))
        if (module, name) not in NOT_AT_MIRROR
    ]


@pytest.mark.parametrize("module", sorted(MIRRORS))
def test_each_torch_name_is_at_the_mirrored_path_and_in_its_all(module: str) -> None:
    theirs = importlib.import_module(module)
    mine = importlib.import_module(MIRRORS[module])
    names = [n for n in public_names(theirs) if (module, n) not in NOT_AT_MIRROR]
    assert [n for n in names if not hasattr(mine, n)] == []
    assert sorted(set(names) - set(mine.__all__)) == []


def test_the_names_said_not_to_be_mirrored_are_torchs_and_absent() -> None:
    for module, name in NOT_AT_MIRROR:
        assert name in public_names(importlib.import_module(module)), (module, name)
        assert not hasattr(importlib.import_module(MIRRORS[module]), name), (module, name)


def test_the_mirrored_names_are_relaunchs_own_objects() -> None:
    """A mirror names relaunch's object: the same one wherever relaunch has it."""
    for module, name in mirrored_names():
        mine = getattr(importlib.import_module(MIRRORS[module]), name)
        home = getattr(mine, "__module__", None)
        if home is not None and (inspect.isclass(mine) or inspect.isfunction(mine)):
            assert home.startswith("relaunch."), (module, name, home)


def test_torchs_calls_are_taken_as_torch_takes_them() -> None:
    found: dict[str, list[str]] = {}
    for module, name in mirrored_names():
        theirs = getattr(importlib.import_module(module), name)
        gaps = api_gaps(theirs, getattr(importlib.import_module(MIRRORS[module]), name))
        if gaps:
            assert found.setdefault(name, gaps) == gaps  # one object, wherever it is named
    assert found == KNOWN_GAPS


def test_classes_are_torchs_kinds() -> None:
    """Each mirrored class derives from what torch's derives from (an ``except`` written for
    torch's exception hierarchy, an ``isinstance`` check, catch the same objects): relaunch's
    own class where relaunch mirrors the base, the standard library's otherwise."""
    mine_by_name = {
        name: getattr(importlib.import_module(MIRRORS[module]), name)
        for module, name in mirrored_names()
    }
    wrong = []
    for module, name in mirrored_names():
        theirs = getattr(importlib.import_module(module), name)
        if not inspect.isclass(theirs):
            continue
        mine = mine_by_name[name]
        for base in theirs.__mro__[1:]:
            if base.__module__.startswith("torch"):
                expected = mine_by_name.get(base.__name__)
            else:
                expected = None if base in (object, abc.ABC, Generic) else base
            if expected is not None and not issubclass(mine, expected):
                wrong.append(f"{module}.{name} is no {base.__name__}")
    assert wrong == []


def test_a_sed_of_the_module_prefix_moves_a_program_over(tmp_path) -> None:
    """The imports torch's docs show, rewritten by the sed docs/python-api.md gives, import."""
    program = "\n".join(
        [
            "from torch.distributed.elastic.multiprocessing import Std, start_processes",
            "from torch.distributed.elastic.multiprocessing.errors import record, ChildFailedError",
            "from torch.distributed.elastic.multiprocessing.errors.error_handler import "
            "ErrorHandler",
            "from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs",
            "from torch.distributed.elastic.rendezvous import RendezvousParameters",
            "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler",
            "from torch.distributed.elastic.agent.server.api import WorkerSpec",
            "from torch.distributed.elastic.agent.server.local_elastic_agent import "
            "LocalElasticAgent",
            "import torch.distributed.elastic.timer as timer",
            "from torch.distributed.elastic import events",
            "from torch.distributed.launcher.api import LaunchConfig, elastic_launch",
            "from torch.distributed.launcher import launch_agent",
            "import sys",
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tor' + 'ch'))",
        ]
    )
    script = tmp_path / "program.py"
    script.write_text(program + "\n")
    sed = subprocess.run(
        ["sed", "-E", "-f", "-", str(script)],
        input=SED,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    moved = tmp_path / "moved.py"
    moved.write_text(sed.stdout)
    assert "torch" not in sed.stdout
    run = subprocess.run(
        [sys.executable, str(moved)], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"  # nothing of torch was imported


#: The sed docs/python-api.md gives (kept equal to it by test_the_docs_give_this_sed).
SED = (
    "s/torch\\.distributed\\.elastic\\.agent\\.server/relaunch.agent/g\n"
    "s/torch\\.distributed\\.launcher(\\.api)?/relaunch.launcher/g\n"
    "s/torch\\.distributed\\.elastic\\.(multiprocessing|rendezvous|timer|events)/relaunch.\\1/g\n"
    "s/from torch\\.distributed\\.elastic import/from relaunch import/g\n"
)


def test_the_docs_give_this_sed() -> None:
    import pathlib

    docs = pathlib.Path(__file__).parents[2] / "docs" / "python-api.md"
    assert SED.strip() in docs.read_text()
