"""docs/layout.md, the map of the code, names every module of src/relaunch and no module that
is gone: a module is named by its path under src/relaunch (`agent/workers.py`,
`agent/__init__.py`) or its dotted name (`relaunch.agent.workers`)."""

from __future__ import annotations

import re

from tests import index

LAYOUT = index.ROOT / "docs" / "layout.md"


def named(module: str, text: str) -> bool:
    """Whether ``text`` names ``module`` (``agent/workers.py``), by path or dotted name."""
    spellings = [module]
    if not module.endswith("__init__.py"):
        spellings.append("relaunch." + module.removesuffix(".py").replace("/", "."))
    return any(re.search(rf"(?<![\w/.]){re.escape(s)}(?![\w/])", text) for s in spellings)


def test_every_module_is_named_in_the_layout() -> None:
    text = LAYOUT.read_text()
    missing = [module for module in index.modules().values() if not named(module, text)]
    assert not missing, (
        f"docs/layout.md names no {len(missing)} module(s) of src/relaunch; add each to its"
        " package's list under 'Every module', one line saying what it does:\n"
        + "\n".join(f"  {module}" for module in missing)
    )


def test_every_file_the_layout_names_exists() -> None:
    """A ``name.py`` in the doc is a module (by its path or the end of it: ``workers.py`` in
    the agent's row) or a file of the repository (``tests/unit/test_layers.py``)."""
    modules = list(index.modules().values())
    gone = sorted(
        {
            name
            for name in re.findall(r"(?<![\w/.])[a-z0-9_/]+\.py\b", LAYOUT.read_text())
            if not (index.ROOT / name).exists()
            and not any(m == name or m.endswith("/" + name) for m in modules)
        }
    )
    assert not gone, "docs/layout.md names files that do not exist: " + ", ".join(gone)


def test_a_module_is_named_by_its_path_or_dotted_name() -> None:
    assert named("agent/workers.py", "- `agent/workers.py`: starts")
    assert named("agent/workers.py", "see relaunch.agent.workers.")
    assert not named("config.py", "`core/config.py`")
    assert not named("agent/workers.py", "`agent/workers.pyc`")
    assert named("agent/__init__.py", "`agent/__init__.py`")
    assert not named("agent/__init__.py", "relaunch.agent")
