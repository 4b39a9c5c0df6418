# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check --root-user-action=ignore

.PHONY: demo test install-test lint

demo:
	$(PIP) -e .
	relaunch --nproc-per-node 4 --tee 3 examples/hello.py

install-test:
	$(PIP) -e '.[test]'

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

test: install-test lint
	$(PYTHON) -m pytest
