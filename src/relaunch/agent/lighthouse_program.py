"""torchft's lighthouse as relaunch runs it: ``PYTHON -I -S <this file> EXTENSION --bind HOST:PORT
--min_replicas N --heartbeat_timeout_ms T --join_timeout_ms J --quorum_tick_ms Q
[--heartbeat REPLICA_ID]...``.

It serves torchft's own lighthouse (``LighthouseServer``, the Rust server the
``torchft_lighthouse`` command runs), loaded from torchft's extension module by its path: the
``torchft_lighthouse`` command imports the ``torchft`` package first, and with it torch, which
takes 1.7-2.6 s before the port listens; the extension alone listens within 0.05-0.07 s, which
is what a restart costs the workers. It imports nothing of relaunch's.

Once it listens it sends one heartbeat for each ``--heartbeat`` replica id (a restart's: the
groups of the last quorum, so that its first quorum waits for them), writes its address
(``http://NAME:PORT``) and a newline on stdout, then reads stdin until its end: the launcher
holds the other end, so the lighthouse leaves however the launcher ends, SIGKILL included.
"""

import importlib.util
import os
import sys
from datetime import timedelta

#: How long each heartbeat sent at the start may take.
HEARTBEAT_TIMEOUT = timedelta(seconds=1)

#: The flags it takes, as ``torchft_lighthouse`` spells them, and the server's argument names.
FLAGS = {
    "--min_replicas": "min_replicas",
    "--heartbeat_timeout_ms": "heartbeat_timeout_ms",
    "--join_timeout_ms": "join_timeout_ms",
    "--quorum_tick_ms": "quorum_tick_ms",
}


def main(argv: list[str]) -> int:
    extension, rest = argv[0], argv[1:]
    pairs = list(zip(rest[::2], rest[1::2], strict=True))
    heartbeats = [value for flag, value in pairs if flag == "--heartbeat"]
    options = {flag: value for flag, value in pairs if flag != "--heartbeat"}
    bind = options.pop("--bind")
    settings = {FLAGS[flag]: int(value) for flag, value in options.items()}
    spec = importlib.util.spec_from_file_location("_torchft", extension)
    if spec is None or spec.loader is None:
        print(f"no extension module at {extension}", file=sys.stderr)
        return 1
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server = module.LighthouseServer(bind=bind, **settings)
    if heartbeats:
        host = bind.rpartition(":")[0]
        host = "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
        _heartbeat(module, f"http://{host}:{server.address().rpartition(':')[2]}", heartbeats)
    sys.stdout.write(f"{server.address()}\n")
    sys.stdout.flush()
    while os.read(0, 4096):
        pass
    server.shutdown()
    return 0


def _heartbeat(module: object, address: str, replicas: list[str]) -> None:
    """One heartbeat for each of ``replicas`` to the lighthouse at ``address``; one that fails
    is said in the log, and the lighthouse serves on."""
    try:
        client = module.LighthouseClient(address, HEARTBEAT_TIMEOUT)  # type: ignore[attr-defined]
        for replica in replicas:
            client.heartbeat(replica, HEARTBEAT_TIMEOUT)
    except Exception as exc:
        print(f"relaunch: heartbeats for the last quorum's groups failed: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
