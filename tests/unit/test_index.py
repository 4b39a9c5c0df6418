"""tests/INDEX.md, the map from each module of src/relaunch to the tests that import it, is
regenerated whenever a module or a test's imports change (tests/index.py)."""

from __future__ import annotations

import ast

from tests import index


def test_the_index_of_tests_by_module_is_current() -> None:
    written = index.INDEX.read_text() if index.INDEX.exists() else ""
    stale = written != index.current()
    assert not stale, (
        f"tests/INDEX.md is stale (a module or a test's imports changed): run `{index.REGENERATE}`"
        " from the repository root and commit the result"
    )


def test_every_import_form_names_its_module() -> None:
    known = {"relaunch.a": "a.py", "relaunch.b": "b/__init__.py", "relaunch.b.c": "b/c.py"}
    source = "import relaunch.a\nfrom relaunch.b import c\nfrom relaunch import b\nrelaunch.b.c.f()"
    for line in source.splitlines():
        names = {name for name in index.imported_names(ast.parse(line)) if name in known}
        assert names, line
    names = index.imported_names(ast.parse("from relaunch.b import c"))
    assert {name for name in names if name in known} == {"relaunch.b", "relaunch.b.c"}
