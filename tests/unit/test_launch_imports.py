"""A single-node launch keeps the launcher lean: what it loads while it runs a job.

Every module costs the launcher start-up time and resident memory (OpenSSL alone, through
hashlib or hmac, maps 3 MiB): what only a multi-node job, a token, a metrics port or a
straggler check needs loads when it is used, not on the way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

#: Loaded only by the features that need them, never by ``--standalone`` without options.
NOT_FOR_A_SINGLE_NODE = (
    "_hashlib",
    "hashlib",
    "hmac",
    "ssl",
    "http.client",
    "statistics",
    "base64",  # a job of several nodes placed in a chosen order
    "termios",  # workers given a terminal
    "relaunch.store.client",
    "relaunch.store.server",
    "relaunch.store.etcd",
    "relaunch.rendezvous.failover",
    "relaunch.rendezvous.kinds_c10d",  # the standalone store is the in-process one
    # events and metrics go nowhere by default: none is built, nor their files opened
    "relaunch.core.output.status_events",
    "relaunch.events.handlers",
    "relaunch.jsonl_file",
    "relaunch.agent.metrics_server",
    "relaunch.procs.tail",
    "relaunch.core.output.screen",
    "relaunch.core.output.status_table",
    "relaunch.timer",
    "relaunch.core.schedulers.inference",
    "relaunch.core.schedulers.kubernetes",
    "relaunch.core.schedulers.mpi",
    "relaunch.core.schedulers.slurm",
    "relaunch.core.workers.state_agreement",
    "_pickle",  # function workers' arguments checked
    "relaunch.procs.duplicates",  # torch's duplicate filters
    "relaunch.rendezvous.static",
    "relaunch.agent.api",  # torch's paths, for code written against them
    "relaunch.agent.local_elastic_agent",
    "relaunch.core.workers.logs_dest",  # torch's LogsDest: a LogsSpecs' reify makes one
)

#: The dataclasses a standalone launch creates: Python 3.11 compiles each one's methods with
#: ``exec``, about 0.45 ms a class. They are the public types torch defines as dataclasses (its
#: events' ``Event``, ``RdzvEvent`` and ``MetricData`` load only when a handler takes them) and
#: the settings groups the config changes with ``dataclasses.replace``; a frozen value of
#: relaunch's own is a ``relaunch.core.value.Value`` and a record whose fields change a plain
#: class with ``__slots__`` (``agent.hooks.Run``, ``WorkerProcess``), which cost microseconds. A
#: new dataclass on the launch path is a choice: change this number with it.
LAUNCH_DATACLASSES = 7


@pytest.fixture(scope="module")
def standalone_launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a standalone launch of two no-op workers left loaded: its exit ``code``, the
    ``modules``, and the ``dataclasses`` among the classes of relaunch's modules."""
    tmp_path = tmp_path_factory.mktemp("launch")
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    probe = (
        "import json, sys\n"
        "from relaunch.cli import main\n"
        f"code = main(['--standalone', '--nproc-per-node', '2', {str(script)!r}])\n"
        "kinds = {value for name, module in list(sys.modules.items())\n"
        "         if name.startswith('relaunch') for value in vars(module).values()\n"
        "         if isinstance(value, type) and value.__module__.startswith('relaunch')}\n"
        "made = sorted(f'{kind.__module__}.{kind.__qualname__}' for kind in kinds\n"
        "              if '__dataclass_fields__' in vars(kind))\n"
        "print(json.dumps({'code': code, 'modules': sorted(sys.modules), 'dataclasses': made}))\n"
    )
    return _probe(probe, tmp_path)


def test_a_standalone_launch_loads_no_network_store_or_crypto(
    standalone_launch: dict[str, Any],
) -> None:
    assert standalone_launch["code"] == 0
    assert sorted(set(NOT_FOR_A_SINGLE_NODE) & set(standalone_launch["modules"])) == []


def test_a_standalone_launch_creates_only_the_dataclasses_it_must(
    standalone_launch: dict[str, Any],
) -> None:
    made = standalone_launch["dataclasses"]
    assert len(made) == LAUNCH_DATACLASSES, (
        f"a standalone launch creates {len(made)} dataclasses, not {LAUNCH_DATACLASSES}:\n  "
        + "\n  ".join(made)
    )


#: Loaded by a standalone launch, but only once its workers started: off their way.
AFTER_THE_WORKERS_START = (
    "socket",  # 2 ms of imports: the listeners are bound with _socket (server_loop.bind_*)
    "relaunch.store.torch_wire",  # torch's store, served once the workers started
)


def test_a_standalone_launch_starts_its_workers_before_it_loads_sockets(tmp_path) -> None:
    """What is loaded when the first worker is started: the agent binds torch's store and the
    parking lot before (a worker that connects early waits in the backlog), and serves them
    once the workers started."""
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    probe = (
        "import json, sys, _posixsubprocess\n"
        "seen = []\n"
        "fork_exec = _posixsubprocess.fork_exec\n"
        "def watched(*args):\n"
        f"    if not seen and {str(script)!r} in args[0]:\n"
        "        seen.append(sorted(sys.modules))\n"
        "    return fork_exec(*args)\n"
        "_posixsubprocess.fork_exec = watched\n"
        "from relaunch.cli import main\n"
        f"code = main(['--standalone', '--nproc-per-node', '2', {str(script)!r}])\n"
        "print(json.dumps({'code': code, 'at_the_first_worker': seen[0] if seen else None,\n"
        "                  'at_the_end': sorted(sys.modules)}))\n"
    )
    launch = _probe(probe, tmp_path)
    assert launch["code"] == 0 and launch["at_the_first_worker"] is not None
    assert sorted(set(AFTER_THE_WORKERS_START) & set(launch["at_the_first_worker"])) == []
    assert set(AFTER_THE_WORKERS_START) <= set(launch["at_the_end"])  # still served


def test_the_collector_is_on_again_before_the_agent_runs(tmp_path) -> None:
    """``console_main`` loads the launcher without the cyclic collector; the agent, which may run
    for days, runs with it (the start-up's objects frozen out of its passes)."""
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    probe = (
        "import gc, json\n"
        "import relaunch.launcher as launcher\n"
        "from relaunch.cli import command\n"
        "seen = []\n"
        "launcher.rendezvous_handler = lambda config: None\n"
        "launcher.launch_agent = lambda *args, **kwargs: seen.append(gc.isenabled())\n"
        "command._collector_off_for_start_up = True  # as console_main leaves it\n"
        "gc.disable()\n"
        f"code = command.main(['--standalone', '--nproc-per-node', '1', {str(script)!r}])\n"
        "print(json.dumps([code, seen, gc.get_freeze_count() > 0]))\n"
    )
    assert _probe(probe, tmp_path) == [0, [True], True]


def _probe(probe: str, tmp_path) -> Any:
    """What ``probe``, run by a fresh interpreter in ``tmp_path``, printed last (JSON)."""
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])
