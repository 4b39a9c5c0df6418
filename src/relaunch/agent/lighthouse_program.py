"""torchft's lighthouse as relaunch runs it: ``PYTHON -I -S <this file> EXTENSION --bind HOST:PORT
--min_replicas N --heartbeat_timeout_ms T --join_timeout_ms J --quorum_tick_ms Q
[--past_quorum ID] [--heartbeat REPLICA_ID]...``.

It serves torchft's own lighthouse (``LighthouseServer``, the Rust server the
``torchft_lighthouse`` command runs), loaded from torchft's extension module by its path: the
``torchft_lighthouse`` command imports the ``torchft`` package first, and with it torch, which
takes 1.7-2.6 s before the port listens; the extension alone listens within 0.05-0.07 s, which
is what a restart costs the workers. It imports nothing of relaunch's.

Once it listens, a restart's lighthouse (``--past_quorum``: the last quorum id its predecessor
logged, ``--heartbeat``: that quorum's replica ids) is driven past that id before anyone else
reaches it: torchft's lighthouse numbers its quorums from 1 and torchft names each quorum's store
prefix by its id, so a quorum id used before would send the groups to a prefix where gloo reads
a dead peer's address. torchft's lighthouse adds one to the id at each quorum whose members
changed or one of whose members reports a failed commit, so one ``ManagerServer`` for each of
those replica ids asks, together, for quorums with a failed commit until the id is past; their
quorum requests and heartbeats count as the groups' heartbeats, and the last quorum is theirs,
so that the lighthouse's first quorum waits for every group of it. Then it writes its address
(``http://NAME:PORT``) and a newline on stdout, and reads stdin until its end: the launcher
holds the other end, so the lighthouse leaves however the launcher ends, SIGKILL included.
"""

import importlib.util
import os
import signal
import sys
import threading
import time
from datetime import timedelta

#: How long the drive's connections may take.
CONNECT_TIMEOUT = timedelta(seconds=1)
#: Seconds the drive past the last quorum id may take in all, and each of its quorums.
DRIVE_TIMEOUT = 10.0
DRIVE_QUORUM_TIMEOUT = timedelta(seconds=2)

#: The flags it takes, as ``torchft_lighthouse`` spells them, and the server's argument names.
FLAGS = {
    "--min_replicas": "min_replicas",
    "--heartbeat_timeout_ms": "heartbeat_timeout_ms",
    "--join_timeout_ms": "join_timeout_ms",
    "--quorum_tick_ms": "quorum_tick_ms",
}


def main(argv: list[str]) -> int:
    # Restarted from the agent's watch thread, it inherits that thread's blocked signals.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    extension, rest = argv[0], argv[1:]
    pairs = list(zip(rest[::2], rest[1::2], strict=True))
    heartbeats = [value for flag, value in pairs if flag == "--heartbeat"]
    options = {flag: value for flag, value in pairs if flag != "--heartbeat"}
    bind = options.pop("--bind")
    past = int(options.pop("--past_quorum", "0"))
    settings = {FLAGS[flag]: int(value) for flag, value in options.items()}
    spec = importlib.util.spec_from_file_location("_torchft", extension)
    if spec is None or spec.loader is None:
        print(f"no extension module at {extension}", file=sys.stderr)
        return 1
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server = module.LighthouseServer(bind=bind, **settings)
    if heartbeats and past > 0:
        host = bind.rpartition(":")[0]
        host = "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
        _drive(module, f"http://{host}:{server.address().rpartition(':')[2]}", heartbeats, past)
    sys.stdout.write(f"{server.address()}\n")
    sys.stdout.flush()
    while os.read(0, 4096):
        pass
    server.shutdown()
    return 0


def _drive(module: object, address: str, replicas: list[str], past: int) -> None:
    """Quorums of ``replicas`` at the lighthouse at ``address``, each through a torchft
    ``ManagerServer`` of its own (on loopback: only this program calls it), all asking at once
    and each saying a failed commit (the lighthouse then adds one to its quorum id even when
    the members did not change), until they have one of them all with an id past ``past``.
    Said in the log; one that fails is said too, and the lighthouse serves on."""
    managers: list[object] = []
    got: dict[str, int] = {}
    failed: list[str] = []
    deadline = time.monotonic() + DRIVE_TIMEOUT

    def ask(replica: str, client: object) -> None:
        try:
            while time.monotonic() < deadline:
                result = client._quorum(  # type: ignore[attr-defined]
                    group_rank=0,
                    step=0,
                    checkpoint_metadata="",
                    shrink_only=False,
                    timeout=DRIVE_QUORUM_TIMEOUT,
                    commit_failures=1,
                    init_sync=False,
                )
                if result.quorum_id > past and result.replica_world_size == len(replicas):
                    got[replica] = result.quorum_id
                    return
            failed.append(f"{replica}: no quorum of them all past {past} in {DRIVE_TIMEOUT}s")
        except Exception as exc:
            failed.append(f"{replica}: {exc}")

    try:
        for replica in replicas:
            managers.append(
                module.ManagerServer(  # type: ignore[attr-defined]
                    replica_id=replica,
                    lighthouse_addr=address,
                    hostname="127.0.0.1",
                    bind="127.0.0.1:0",
                    store_addr="",
                    world_size=1,
                    heartbeat_interval=timedelta(milliseconds=100),
                    connect_timeout=CONNECT_TIMEOUT,
                    quorum_retries=0,
                )
            )
        clients = [
            module.ManagerClient(manager.address(), CONNECT_TIMEOUT)  # type: ignore[attr-defined]
            for manager in managers
        ]
        threads = [
            threading.Thread(target=ask, args=pair, daemon=True)
            for pair in zip(replicas, clients, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except Exception as exc:
        failed.append(str(exc))
    finally:
        for manager in managers:
            manager.shutdown()  # type: ignore[attr-defined]
    if failed:
        print(f"relaunch: driving the quorum id past {past} failed: {failed[0]}", file=sys.stderr)
    else:
        print(f"relaunch: quorum id driven past {past} to {max(got.values())}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
