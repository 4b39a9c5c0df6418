"""Defaults and bounds that the config, the flags and the pure parsers name, and the one reading of
torch's ``NumaOptions``: here, so that reading them (``relaunch --help``, a ``LaunchConfig``, a
``WorkerSpec``) loads neither the process layer, the config nor the placement."""

from __future__ import annotations

#: The size past which a JSON-lines file (the event and metric logs: ``jsonl_file``) is rotated:
#: renamed to ``PATH.1`` (replacing the one before), and a new ``PATH`` begun. A file and its
#: predecessor hold at most twice this.
MAX_LOG_BYTES = 64 * 1024 * 1024
#: Default seconds between the stop signal and SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: How function workers may be started (multiprocessing's start methods).
START_METHODS = ("spawn", "fork", "forkserver")
#: torch 2.13's ``--numa-binding`` modes (``torch.numa.binding.AffinityMode``; see
#: ``core.workers.placement``).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
#: Default seconds a node whose workers finished waits for the other nodes' (torchrun's).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0
#: Default seconds a ``--health-check`` command may run before it counts as failed.
DEFAULT_HEALTH_CHECK_TIMEOUT = 60.0
#: Default seconds between a failed ``--health-check`` and the next try.
DEFAULT_HEALTH_CHECK_COOLDOWN = 30.0
#: The most workers one node may run (``--nproc-per-node``): twice the hardware threads of the
#: largest common two-socket machines (2 x 128 cores x 2 threads), so that ``cpu`` and any
#: sensible oversubscription fit, while a typo (65536) is refused before anything forks. Each
#: worker is a process with its own pipes and log files: past this, a node runs out of memory
#: or descriptors long before the job does useful work.
MAX_NPROC_PER_NODE = 1024
#: The longest any duration may be, in seconds (about 11.6 days): every wait the agent makes
#: must fit the kernel's (``poll`` takes at most 2**31 - 1 ms, about 24.8 days).
MAX_SECONDS = 1_000_000.0


def numa_binding_of(options: object) -> str:
    """The ``--numa-binding`` mode of torch's ``NumaOptions`` (its ``affinity_mode``: an
    ``AffinityMode`` or its text); ValueError when relaunch has no such mode. relaunch always
    falls back to running a rank unbound, with a warning, when it cannot bind it
    (torch's ``should_fall_back_if_binding_fails=True``)."""
    mode = getattr(options, "affinity_mode", None)
    text = str(getattr(mode, "value", mode))
    if text not in NUMA_MODES:
        raise ValueError(
            f"numa_options affinity_mode {mode!r} has no relaunch NUMA binding: expected one of "
            + ", ".join(NUMA_MODES)
        )
    return text
