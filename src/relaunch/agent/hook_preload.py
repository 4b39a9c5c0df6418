"""``--preload`` as an attempt hook: the zygote each Python worker is forked from (it imports
the modules while the agent joins)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from relaunch.agent.hooks import AttemptHook, Run
from relaunch.config import ConfigError
from relaunch.core.run.stop_plan import Feature, StopPhase
from relaunch.core.workers.ranks import omp_num_threads_default
from relaunch.procs.context import PContext

if TYPE_CHECKING:
    from relaunch.procs.zygote import Zygote

log = logging.getLogger("relaunch.agent.workers")


def attach(run: Run) -> PreloadHook | None:
    return PreloadHook() if run.preload else None


class PreloadHook(AttemptHook):
    """Starts workers from the zygote."""

    def __init__(self) -> None:
        self.zygote: Zygote | None = None

    def open(self, run: Run) -> None:
        self.zygote = _start_zygote(run)

    def wrap_start(self, run: Run, start: Callable[..., PContext]) -> Callable[..., PContext]:
        zygote = self.zygote
        if zygote is None:
            return start

        def from_zygote(**arguments: Any) -> PContext:
            with _bad_preload_is_bad_input():
                return start(**arguments, zygote=zygote)

        return from_zygote

    def features(self) -> Collection[Feature]:
        return [] if self.zygote is None else [Feature.ZYGOTE]

    def stop_phases(self, run: Run) -> Mapping[StopPhase, Callable[[], None]]:
        if self.zygote is None:
            return {}
        return {StopPhase.REVIVE_ZYGOTE: self.zygote.revive}  # one that died imports again

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()


def _start_zygote(run: Run) -> Zygote | None:
    """The zygote of ``--preload``, started (it imports while the agent joins), with the
    launcher's environment and what every worker gets on top of it; None (said) when the
    workers are no Python script or module, or are started by a user's start_processes."""
    from relaunch.procs.zygote import Zygote  # sockets: only with --preload
    from relaunch.procs.zygote_command import python_command

    spec = run.group.spec
    modules = ",".join(run.preload)
    command = None
    if isinstance(spec.entrypoint, str):
        command = python_command([spec.entrypoint, *map(str, spec.args)])
    if command is None:
        log.warning("--preload %s: the workers are no Python script or module: cold", modules)
        return None
    if not run.own_start:
        log.warning("--preload %s: a start_processes of your own starts them cold", modules)
        return None
    assert run.channel is not None
    omp = omp_num_threads_default(spec.local_world_size, os.environ)
    env = {
        **os.environ,
        **run.expiry.worker_env(),
        **run.channel.env(),
        **run.open_env,
        **({} if omp is None else {"OMP_NUM_THREADS": omp}),
    }
    zygote = Zygote(run.preload, command, env)
    zygote.start()
    return zygote


@contextlib.contextmanager
def _bad_preload_is_bad_input() -> Iterator[None]:
    """What the zygote cannot import (``PreloadError``) is the user's mistake: ``ConfigError``."""
    from relaunch.procs.zygote import PreloadError  # sockets: only with --preload

    try:
        yield
    except PreloadError as exc:
        raise ConfigError(str(exc)) from None
