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

#: Loaded only by the features that need them, never by ``--standalone`` without options.
NOT_FOR_A_SINGLE_NODE = (
    "_hashlib",
    "hashlib",
    "hmac",
    "ssl",
    "http.client",
    "statistics",
    "relaunch.store.client",
    "relaunch.store.server",
    "relaunch.store.etcd",
    "relaunch.rendezvous.failover",
    "relaunch.agent.metrics_server",
    "relaunch.procs.tail",
    "relaunch.core.output.screen",
    "relaunch.timer",
)


def test_a_standalone_launch_loads_no_network_store_or_crypto(tmp_path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    probe = (
        "import json, sys\n"
        "from relaunch.cli import main\n"
        f"code = main(['--standalone', '--nproc-per-node', '2', {str(script)!r}])\n"
        "print(json.dumps([code, sorted(sys.modules)]))\n"
    )
    code, modules = _probe(probe, tmp_path)
    assert code == 0
    assert sorted(set(NOT_FOR_A_SINGLE_NODE) & set(modules)) == []


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
