"""The rendezvous join: once this node may (it left its running round, waited out a crash
loop's backoff and any exclusion from the job, ``core.run.exclusion``, and passed its health check,
``agent.health``), its worker group takes its place in the next round."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from relaunch.agent.health import HealthCheck, check_env, run_check
from relaunch.agent.spec import WorkerGroup
from relaunch.rendezvous.api import RendezvousClosedError
from relaunch.rendezvous.job import JobServices
from relaunch.runtime import SYSTEM_CLOCK, Clock

log = logging.getLogger("relaunch.agent.health")


def await_admission(
    job: JobServices,
    run_id: str,
    check: HealthCheck | None,
    env: Mapping[str, str],
    backoff: float = 0.0,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Return once this node may join: it left its running round (so the others stop at
    once), waited ``backoff`` seconds (a crash loop's), is not excluded from the job, and
    passed its health check. Says on the console why it waits, and until when (an exclusion
    ends at a ``clock.time()``); ``RendezvousClosedError`` when the job finishes meanwhile."""
    while True:
        until = job.prepare_join()
        if backoff > 0:
            if job.wait_closed(backoff):
                raise RendezvousClosedError(f"the job {run_id!r} has finished")
            backoff = 0.0
            continue
        if until is not None:
            log.warning(
                "this node is excluded from the job until %s (%s); it will try to join again then",
                time.strftime("%H:%M:%S", time.localtime(until)),
                job.exclusion_reason,
            )
            if job.wait_closed(until - clock.time()):
                raise RendezvousClosedError(f"the job {run_id!r} has finished")
            continue
        if check is None:
            return
        result = run_check(check, env)
        if result.healthy:
            return
        quoted = f": {result.last_line!r}" if result.last_line else ", no output"
        log.warning(
            "health check failed (%s%s): %s; not joining, trying again in %gs",
            result.status,
            quoted,
            check.command,
            check.cooldown,
        )
        if job.wait_closed(check.cooldown):
            raise RendezvousClosedError(f"the job {run_id!r} has finished")


def join(
    job: JobServices,
    group: WorkerGroup,
    check: HealthCheck | None,
    backoff: float,
    restarts: int,
    clock: Clock = SYSTEM_CLOCK,
) -> float:
    """Join the next round once this node may (``await_admission``, after ``backoff``
    seconds; the job has used ``restarts`` restarts): ``group`` takes its place in it. The
    seconds the join took, from when this node was admitted."""
    spec = group.spec
    run_id = spec.rdzv_handler.get_run_id()
    env = check_env(spec.local_world_size, run_id, spec.role, restarts)
    job.set_workers(spec.role, spec.local_world_size)  # what this node's join carries
    await_admission(job, run_id, check, env, backoff, clock)
    began = clock.monotonic()
    group.join(spec.rdzv_handler.next_rendezvous())
    return clock.monotonic() - began
