"""The layers of relaunch, read from the source: no import cycles, a pure core, and no layer
importing one above it.

The graph has an edge for every import of a relaunch module, at module level or inside a
function (a lazy import is still a dependency); imports under ``if TYPE_CHECKING:`` are left
out, as they never run. ``from package import name`` is an edge to ``package.name`` when that
is a module, else to the package itself (its ``__init__``), so a package's ``__init__`` that
re-exports its submodules has an edge to each of them, and a submodule that imports from its
own package's ``__init__`` closes a cycle. The implicit import of a parent package when a
submodule loads is not an edge: it runs no code the submodule depends on.

A second, stricter graph (``strict_graph``, as issue 44's counting tool reads the source) must
have no cycle either: it keeps the ``TYPE_CHECKING`` imports, and ``from package import name``
is an edge to the package's ``__init__`` as well, so a submodule imports its siblings by their
module path (``import relaunch.store.wire as wire``) and never closes a cycle with an
``__init__`` that re-exports them.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sys
from collections.abc import Iterator

import pytest

import relaunch

SRC = pathlib.Path(relaunch.__file__).parent
#: Standard library modules core must not import: core is decisions, not I/O, threads or time.
FORBIDDEN_IN_CORE = {"os", "subprocess", "socket", "threading", "time", "select", "selectors"}

#: Each part of relaunch (a package or a top-level module) and the parts it may import, which
#: are below it; every part has a row (``test_every_part_has_a_layer``). From the top: ``cli``
#: turns argv into a config and runs ``launcher``, which builds the ``agent`` from the config
#: and the machine (``placement``); the agent drives ``rendezvous`` (over ``store``), ``procs``,
#: ``timer`` and ``events``; ``config``, ``endpoints`` and ``runtime`` sit just above ``core``
#: (pure: its own test), and ``worker`` is what a worker imports: core only.
FOUNDATIONS = ("relaunch.core", "relaunch.endpoints", "relaunch.runtime")
MAY_IMPORT = {
    "relaunch": (),  # its public names load on first use (PEP 562): no import at all
    "relaunch.__main__": ("relaunch.cli",),
    "relaunch.cli": ("*",),  # the top: anything
    "relaunch.launcher": (
        *FOUNDATIONS,
        "relaunch.config",
        "relaunch.placement",
        "relaunch.agent",
        "relaunch.events",
        "relaunch.rendezvous",
        "relaunch.procs",
        "relaunch.timer",
        "relaunch.store",
    ),
    "relaunch.placement": (*FOUNDATIONS, "relaunch.config"),
    "relaunch.agent": (
        *FOUNDATIONS,
        "relaunch.config",  # ConfigError: bad input found only when starting (a metrics port)
        "relaunch.placement",  # a WorkerSpec's numa_options and virtual_local_rank (torch's)
        "relaunch.events",
        "relaunch.jsonl_file",
        "relaunch.rendezvous",
        "relaunch.procs",
        "relaunch.timer",
        "relaunch.store",
        "relaunch.state",  # the slot files of the state its workers keep
        "relaunch.in_place",  # what the parking lot and its ranks say
        "relaunch.server_loop",  # the metrics endpoint, the parking lot, the state peers
    ),
    "relaunch.rendezvous": (*FOUNDATIONS, "relaunch.store"),
    "relaunch.events": (*FOUNDATIONS, "relaunch.jsonl_file"),
    "relaunch.procs": (*FOUNDATIONS, "relaunch.jsonl_file", "relaunch.pickling"),
    # torch's multiprocessing[.api|.errors|.tail_log] paths, naming what relaunch.procs holds
    "relaunch.multiprocessing": (*FOUNDATIONS, "relaunch.procs"),
    "relaunch.timer": FOUNDATIONS,
    "relaunch.store": (*FOUNDATIONS, "relaunch.server_loop"),
    "relaunch.jsonl_file": FOUNDATIONS,
    "relaunch.config": FOUNDATIONS,
    "relaunch._run_path": (),
    "relaunch.worker": ("relaunch.core",),
    # what a worker imports to restart in place (relaunch.restart_in_place)
    "relaunch.in_place": ("relaunch.core", "relaunch.worker"),
    # what a worker imports to keep its state in the agent (relaunch.save_state)
    "relaunch.state": ("relaunch.core", "relaunch.pickling", "relaunch.worker"),
    "relaunch.pickling": (),
    "relaunch.endpoints": ("relaunch.core",),
    "relaunch.runtime": ("relaunch.core",),
    # the one selector thread that every server (store, metrics, parking, state peers) runs on
    "relaunch.server_loop": ("relaunch.core", "relaunch.runtime"),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        runs = node.orelse if isinstance(node, ast.If) and is_type_checking(node.test) else [node]
        for child in runs:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            yield from imports(child)


def source(module: str, node: ast.ImportFrom) -> str:
    """The full name of the module or package ``from ... import`` (in ``module``) reads from."""
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return base


def imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules ``node`` (in ``module``) imports, by full name."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = source(module, node)
    submodules = (f"{base}.{alias.name}" for alias in node.names)
    return {name if name in MODULES else base for name in submodules}


@functools.cache  # read once: each part's test reads it (the source does not change meanwhile)
def graph() -> dict[str, set[str]]:
    """Each relaunch module and the relaunch modules it imports."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        names = set().union(*(imported(module, node) for node in imports(tree)))
        edges[module] = {name for name in names if name in MODULES and name != module}
    return edges


def imported_strictly(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """``imported``, plus the package itself for ``from package import name``: its ``__init__``
    runs first, and the name is looked up there."""
    names = imported(module, node)
    return names | {source(module, node)} if isinstance(node, ast.ImportFrom) else names


def strict_graph() -> dict[str, set[str]]:
    """``graph`` with the ``TYPE_CHECKING`` imports and an edge to each package imported from."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        nodes = ast.walk(ast.parse(path.read_text(), str(path)))
        found = (node for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom)))
        names = set().union(*(imported_strictly(module, node) for node in found))
        edges[module] = {name for name in names if name in MODULES and name != module}
    return edges


def all_imports(module: str) -> set[str]:
    """Every module ``module`` imports, relaunch or not (top-level names for the others)."""
    tree = ast.parse(MODULES[module].read_text())
    names = set().union(*(imported(module, node) for node in imports(tree)))
    return {name if under(name, "relaunch") else name.split(".")[0] for name in names}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    edges = graph()
    assert (
        "relaunch.core.rendezvous.rounds" in edges["relaunch.rendezvous.rounds"]
    )  # from pkg import mod
    assert "relaunch.rendezvous.api" in edges["relaunch.rendezvous"]  # __init__ re-exports
    assert "relaunch.store.memory" in edges["relaunch.rendezvous.backends"]  # inside a function
    assert "relaunch.store.etcd" not in edges["relaunch.rendezvous.heartbeat"]  # TYPE_CHECKING


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_strict_graph_sees_packages_imported_from() -> None:
    def read(module: str, line: str) -> set[str]:
        node = ast.parse(line).body[0]
        assert isinstance(node, (ast.Import, ast.ImportFrom))
        return imported_strictly(module, node)

    client, wire = "relaunch.store.client", "relaunch.store.wire"
    both = {"relaunch.store", wire}
    assert read(client, "from relaunch.store import wire") == both
    assert read(client, "from . import wire") == both
    assert read(client, "import relaunch.store.wire as wire") == {wire}
    assert read(client, "from relaunch.store.wire import encode") == {wire}


def test_no_import_cycles_through_a_package_init_or_type_checking() -> None:
    """A module imports its siblings by their module path, never from its package's
    ``__init__`` (which may re-export it), and no cycle hides under ``TYPE_CHECKING``."""
    assert cycles(strict_graph()) == []


def test_core_imports_only_core_and_the_pure_standard_library() -> None:
    for module in MODULES:
        if not under(module, "relaunch.core"):
            continue
        for name in all_imports(module):
            if under(name, "relaunch"):
                assert under(name, "relaunch.core"), f"{module} imports {name}"
            else:
                assert name in sys.stdlib_module_names or name == "__future__", (
                    f"{module} imports {name}, which is not in the standard library"
                )
                assert name not in FORBIDDEN_IN_CORE, f"{module} imports {name}"


def part_of(module: str) -> str:
    """The part of relaunch ``module`` belongs to: its package or top-level module."""
    return ".".join(module.split(".")[:2])


def test_every_part_has_a_layer() -> None:
    parts = {part_of(module) for module in MODULES}
    assert parts - {"relaunch.core"} == set(MAY_IMPORT)


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_no_part_imports_one_above_it(part: str) -> None:
    """Each import from ``part`` to another part is to one below it (``MAY_IMPORT``)."""
    allowed = MAY_IMPORT[part]
    wrong = {
        f"{module} imports {target}"
        for module, targets in graph().items()
        if part_of(module) == part
        for target in targets
        if part_of(target) != part
        and "*" not in allowed
        and not any(under(target, below) for below in allowed)
    }
    assert wrong == set()
