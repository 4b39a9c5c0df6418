"""Test support shared with the benchmarks: importable as ``tests.support`` from the repo root
(``tests`` is a namespace package: it has no ``__init__.py``, so pytest's rootdir conftest
imports are unchanged)."""
