"""The metrics an agent serves to Prometheus (``--metrics-port``), in the text exposition
format 0.0.4: the catalogue of every metric (``CATALOGUE``: name, type, help), the samples of one
scrape (``Family``), a histogram, and the text. Written by hand, not with ``prometheus_client``:
the format is a few lines, and the library costs about 50 ms to import.

Pure: values in, text out; the agent side (``relaunch.agent.metrics``) takes the samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from relaunch.core.rendezvous.membership import ChangeKind

if TYPE_CHECKING:
    from relaunch.core.output.status import RankStatus
    from relaunch.core.run.run_events import RankSample

#: The media type Prometheus expects for this format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The states of one worker (``relaunch_worker_state``): running, ended while others run
#: (``exited``), and how its group ended: ``succeeded``, ``failed``, or ``stopped`` because
#: another rank failed.
WORKER_STATES = ("running", "exited", "succeeded", "failed", "stopped")

#: The causes of a group restart (``relaunch_group_restarts_total``): a local worker failed, a
#: worker hung on some node, or the kind of the membership change that re-formed the group.
RESTART_CAUSES = (
    "worker_failed",
    "hang",
    *(kind.value for kind in ChangeKind if kind not in (ChangeKind.FAILED, ChangeKind.FINISHED)),
)

#: Upper bounds (seconds) of the rendezvous duration histogram's buckets.
RENDEZVOUS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: One rank's value of a per-rank gauge: from its status (steps, rate, last sign), its sample of
#: the tick's snapshot (its whole progress and liveness records), whether it is flagged a
#: straggler, and the time of the scrape (``time.time()``); None: no sample.
RankValue = Callable[["RankStatus", "RankSample", bool, float], "float | None"]

#: The per-rank gauges (``relaunch_rank_*``): name -> (help, value). A new one is one line here
#: (and its panel in docs/grafana-dashboard.json).
RANK_GAUGES: dict[str, tuple[str, RankValue]] = {
    "relaunch_rank_step": (
        "Each rank's last step (relaunch.report_progress).",
        lambda status, sample, straggler, now: status.step,
    ),
    "relaunch_rank_total_steps": (
        "Each rank's total steps, where it gave one.",
        lambda status, sample, straggler, now: status.total,
    ),
    "relaunch_rank_steps_per_second": (
        "Each rank's steps per second over the last 12 s (sampled every 3 s).",
        lambda status, sample, straggler, now: status.rate,
    ),
    "relaunch_rank_seconds_since_last_sign": (
        "Seconds since each rank's last sign of life (progress, heartbeat or section).",
        lambda status, sample, straggler, now: (
            None if status.last_sign is None else max(0.0, now - status.last_sign)
        ),
    ),
    "relaunch_rank_straggler": (
        "1 when the rank is flagged a straggler: its node's ranks spend --straggler-factor times "
        "the other nodes' time in a section, or it steps below the job's median rate / the factor.",
        lambda status, sample, straggler, now: 1.0 if straggler else 0.0,
    ),
}

#: Every metric an agent serves: name -> (type, help). Every sample carries the labels
#: ``run_id`` and ``node``; the ``relaunch_rank_*`` and ``relaunch_worker_state`` samples also
#: ``group_rank``, ``rank`` and ``local_rank``.
CATALOGUE: dict[str, tuple[str, str]] = {
    "relaunch_agent_info": ("gauge", "The agent: its role and rendezvous backend (always 1)."),
    "relaunch_group_state": ("gauge", "The worker group's state (1 for the current one)."),
    "relaunch_group_rank": ("gauge", "This node's group rank in the current round."),
    "relaunch_group_world_size": ("gauge", "Nodes in the current round."),
    "relaunch_worker_state": ("gauge", "Each worker's state (1 for the current one)."),
    "relaunch_group_restarts_total": (
        "counter",
        "Restarts of this node's worker group, by cause (worker_failed, hang, or a membership "
        "change: nodes_waiting, member_lost, member_left, member_excluded, member_evicted, "
        "restarting, store_lost).",
    ),
    "relaunch_restarts_used": ("gauge", "Restarts the job has used (every node's failures)."),
    "relaunch_max_restarts": ("gauge", "The job's restart budget (--max-restarts)."),
    "relaunch_rendezvous_rounds_total": ("counter", "Rendezvous rounds this agent joined."),
    "relaunch_rendezvous_duration_seconds": (
        "histogram",
        "Seconds each join took, from asking to join to the place in the round.",
    ),
    **{name: ("gauge", help_text) for name, (help_text, _) in RANK_GAUGES.items()},
    "relaunch_store_round_trip_seconds": (
        "gauge",
        "Seconds the last write of this node's status to the rendezvous store took.",
    ),
    "relaunch_restart_lost_seconds_total": (
        "counter",
        "Seconds this node lost to restarts, by cause (detection, teardown, health_check, "
        "rendezvous, worker_start, state_restore, recomputation).",
    ),
    "relaunch_goodput_ratio": (
        "gauge",
        "The share of the run so far not lost to restarts (1: none lost).",
    ),
}

Labels = tuple[tuple[str, str], ...]


class Sample:
    """One line of a family: its name's suffix (``_bucket``, ``_sum``, ...), labels and value.

    A plain class, not a dataclass: this module loads with every agent, metrics or not."""

    __slots__ = ("labels", "suffix", "value")

    def __init__(self, labels: Labels, value: float, suffix: str = "") -> None:
        self.labels, self.value, self.suffix = labels, value, suffix


class Family:
    """The samples of one metric of the catalogue, in one scrape."""

    __slots__ = ("name", "samples")

    def __init__(self, name: str, samples: Sequence[Sample] = ()) -> None:
        self.name, self.samples = name, samples


class Histogram:
    """Observations counted into cumulative buckets, with their sum and count."""

    def __init__(self, bounds: Sequence[float] = RENDEZVOUS_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1

    def samples(self, labels: Labels) -> list[Sample]:
        """The ``_bucket`` (with ``le``, ``+Inf`` last), ``_sum`` and ``_count`` samples."""
        out = [
            Sample((*labels, ("le", format_value(bound))), count, "_bucket")
            for bound, count in zip(self.bounds, self.counts, strict=True)
        ]
        out.append(Sample((*labels, ("le", "+Inf")), self.count, "_bucket"))
        out.append(Sample(labels, self.total, "_sum"))
        out.append(Sample(labels, self.count, "_count"))
        return out


def enum_samples(labels: Labels, states: Iterable[str], current: str) -> list[Sample]:
    """One sample per state, labelled ``state``: 1 for ``current``, 0 for the others."""
    return [Sample((*labels, ("state", s)), 1.0 if s == current else 0.0) for s in states]


def escape_label(value: str) -> str:
    """A label value as the format writes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: whole numbers without a fraction, ``+Inf``, ``-Inf`` and ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def exposition(
    families: Iterable[Family], catalogue: Mapping[str, tuple[str, str]] = CATALOGUE
) -> str:
    """The text of one scrape: ``# HELP`` and ``# TYPE`` for each family, then its samples."""
    lines = []
    for family in families:
        kind, help_text = catalogue[family.name]
        lines.append(f"# HELP {family.name} {escape_help(help_text)}")
        lines.append(f"# TYPE {family.name} {kind}")
        for sample in family.samples:
            labels = ",".join(f'{key}="{escape_label(value)}"' for key, value in sample.labels)
            name = family.name + sample.suffix
            text = f"{name}{{{labels}}}" if labels else name
            lines.append(f"{text} {format_value(sample.value)}")
    return "\n".join(lines) + "\n"


def metric_names(text: str) -> set[str]:
    """The metric names an exposition declares (its ``# TYPE`` lines)."""
    return {
        line.split()[2]
        for line in text.splitlines()
        if line.startswith("# TYPE ") and len(line.split()) >= 4
    }
