# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check --root-user-action=ignore

.PHONY: demo test install-test lint

demo:
	$(PIP) -e .
	relaunch --nproc-per-node 4 --tee 3 examples/hello.py

# Tests run real etcd members on free loopback ports; Debian's etcd-server provides the binary.
# tests/integration/test_prometheus.py scrapes the agents with a real Prometheus: Debian's prometheus.
# tests/integration/test_mpi.py starts relaunch with a real mpirun: Debian's openmpi-bin.
# tests/integration/test_slurm.py runs a real Slurm cluster on this machine, as root: Debian's slurm-wlm, munge.
# The torch tests need torch 2.13.0 (its CPU wheel is on this machine's disk): never a newer one.
# Byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set (as on these machines), each of
# the many processes the tests start would compile relaunch again (a launch 1.5-2.0 s, not 0.7-0.9 s,
# on a loaded machine); an editable install, unlike a wheel's, compiles nothing.
install-test:
	$(PIP) -e '.[test]' torch==2.13.0
	$(PYTHON) -m compileall -q -j 0 src tests
	command -v etcd >/dev/null || { SUDO=$$(test "$$(id -u)" = 0 || command -v sudo); $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; }
	command -v prometheus >/dev/null || { SUDO=$$(test "$$(id -u)" = 0 || command -v sudo); $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }
	command -v mpirun >/dev/null || { SUDO=$$(test "$$(id -u)" = 0 || command -v sudo); $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin; }
	command -v slurmctld >/dev/null || { SUDO=$$(test "$$(id -u)" = 0 || command -v sudo); $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; }

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

# Three xdist workers on two cores: tests that wait on processes overlap; the torch tests,
# which keep both cores busy, run one after another in one group.
test: install-test lint
	$(PYTHON) -m pytest -n 3 --dist loadgroup
