"""A stop request (the first SIGTERM/SIGINT): ask the workers to stop
(``relaunch.stop_requested``), give them the shutdown timeout, then the signal for the rest."""

from __future__ import annotations

import logging

from relaunch.agent.channel import Channel
from relaunch.agent.report import RunReport
from relaunch.core.durations import seconds
from relaunch.procs.context import PContext
from relaunch.procs.errors import SignalException, StopRequested

log = logging.getLogger("relaunch.agent.workers")


def stop_gracefully(
    request: StopRequested,
    channel: Channel,
    pcontext: PContext,
    shutdown_timeout: float,
    report: RunReport,
) -> SignalException:
    """Ask the workers to stop, give them ``shutdown_timeout`` seconds, then stop the rest.

    Only when a running worker listens (has called ``stop_requested()``); otherwise the
    workers are stopped at once, as by torchrun. Returns the exception to end the run with:
    the request, or a second signal. What came of it is ``report.stop_note``.
    """
    if not any(channel.listening(rank) for rank in pcontext.running()):
        return request  # nobody would hear it: stop them with the signal at once
    channel.request_stop()
    try:
        log.warning(
            "%s: asking the workers to stop (relaunch.stop_requested()); waiting up "
            "to %gs for them (send %s again to stop them now)",
            request.sigval.name,
            shutdown_timeout,
            request.sigval.name,
        )
        outcome = pcontext.wait(shutdown_timeout)
    except SignalException as again:
        report.stop_note = f"{again.sigval.name} again: the workers were stopped at once"
        return again
    if outcome is not None and not outcome.is_failed():
        note = "the workers stopped cleanly after the stop request (all exited 0)"
    elif outcome is not None:
        note = "the workers stopped after the stop request, some of them failing"
    else:
        running = len(pcontext.running())
        note = (
            f"{running} worker(s) did not stop within "
            f"{seconds(shutdown_timeout)} of the request and were sent "
            f"{request.sigval.name}"
        )
    report.stop_note = note
    return request
