"""The process layer's defaults that the config and the flags name too: here, so that reading
them (``relaunch --help``, a ``LaunchConfig``) does not load the process layer."""

from __future__ import annotations

#: Default seconds between the stop signal and SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: How function workers may be started (multiprocessing's start methods).
START_METHODS = ("spawn", "fork", "forkserver")
#: torch 2.13's ``--numa-binding`` modes (``torch.numa.binding.AffinityMode``; see
#: ``core.placement``).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
#: Default seconds a node whose workers finished waits for the other nodes' (torchrun's).
DEFAULT_EXIT_BARRIER_TIMEOUT = 300.0
#: Default seconds a ``--health-check`` command may run before it counts as failed.
DEFAULT_HEALTH_CHECK_TIMEOUT = 60.0
#: Default seconds between a failed ``--health-check`` and the next try.
DEFAULT_HEALTH_CHECK_COOLDOWN = 30.0
