"""Prometheus metrics (``--metrics-port``): the exposition text, the agent's values served over
HTTP while it runs, the flag, a port in use, and the Grafana dashboard in docs/."""

from __future__ import annotations

import json
import pathlib
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from conftest import wait_until

from relaunch import cli
from relaunch.agent import LocalElasticAgent, WorkerSpec
from relaunch.agent.metrics import AgentMetrics
from relaunch.agent.sampler import Sampler
from relaunch.agent.spec import WorkerGroup
from relaunch.agent.status import Group, NodeReporter
from relaunch.config import ConfigError
from relaunch.core.output import metrics as core
from relaunch.core.output.status import JobView
from relaunch.core.workers.progress import Progress
from relaunch.procs.context import RunProcsResult
from relaunch.procs.errors import ProcessFailure
from relaunch.rendezvous.api import RendezvousHandler, RendezvousInfo

pytestmark = pytest.mark.timeout(30)

DASHBOARD = pathlib.Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"
NPROCS = 2


# -- the text ------------------------------------------------------------------------------------


def test_the_exposition_escapes_labels_and_writes_help_type_and_values() -> None:
    labels = (("node", 'a"b\\c\nd'), ("rank", "0"))
    text = core.exposition(
        [
            core.Family("relaunch_rank_step", [core.Sample(labels, 12)]),
            core.Family("relaunch_store_round_trip_seconds", [core.Sample((), 0.25)]),
            core.Family("relaunch_rank_steps_per_second", []),
        ]
    )
    assert text.splitlines() == [
        "# HELP relaunch_rank_step Each rank's last step (relaunch.report_progress).",
        "# TYPE relaunch_rank_step gauge",
        'relaunch_rank_step{node="a\\"b\\\\c\\nd",rank="0"} 12',
        "# HELP relaunch_store_round_trip_seconds "
        + core.CATALOGUE["relaunch_store_round_trip_seconds"][1],
        "# TYPE relaunch_store_round_trip_seconds gauge",
        "relaunch_store_round_trip_seconds 0.25",
        "# HELP relaunch_rank_steps_per_second "
        + core.CATALOGUE["relaunch_rank_steps_per_second"][1],
        "# TYPE relaunch_rank_steps_per_second gauge",
    ]
    assert [core.format_value(v) for v in (3.0, 1e20, float("inf"), float("nan"), -0.5)] == [
        "3",
        "1e+20",
        "+Inf",
        "NaN",
        "-0.5",
    ]


def test_a_histogram_counts_into_cumulative_buckets() -> None:
    histogram = core.Histogram((1.0, 5.0))
    for value in (0.5, 2.0, 7.0):
        histogram.observe(value)
    samples = histogram.samples((("node", "n"),))
    assert [(s.suffix, dict(s.labels).get("le"), s.value) for s in samples] == [
        ("_bucket", "1", 1),
        ("_bucket", "5", 2),
        ("_bucket", "+Inf", 3),
        ("_sum", None, 9.5),
        ("_count", None, 3),
    ]


def test_names_follow_prometheus_conventions() -> None:
    for name, (kind, _) in core.CATALOGUE.items():
        assert re.fullmatch(r"relaunch_[a-z_]+", name), name
        assert name.endswith("_total") == (kind == "counter"), name
    assert "worker_failed" in core.RESTART_CAUSES and "member_lost" in core.RESTART_CAUSES
    assert "failed" not in core.RESTART_CAUSES  # the job's end is no restart


# -- the agent's values --------------------------------------------------------------------------


class Handler(RendezvousHandler):
    """This node, group rank 0 of one, in one round after another."""

    identity = "host-a"

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=29500,
            rank_offset=0,
            global_world_size=NPROCS,
        )

    def get_backend(self) -> str:
        return "fake"

    def get_run_id(self) -> str:
        return "unit"


class Context:
    """A ``PContext`` the test ends with ``result``."""

    def __init__(self) -> None:
        self.result: RunProcsResult | None = None
        self.callbacks: list = []
        self.stdouts = dict.fromkeys(range(NPROCS), "")
        self.stderrs = dict.fromkeys(range(NPROCS), "")

    def pids(self) -> dict[int, int]:
        return {rank: 1_000_000 + rank for rank in range(NPROCS)}

    def running(self) -> set[int]:
        return set() if self.result else set(range(NPROCS))

    def wait(self, timeout: float = -1) -> RunProcsResult | None:
        return self.result

    def add_done_callback(self, fn) -> None:
        self.callbacks.append(fn)
        if self.result is not None:
            fn()

    def end(self, result: RunProcsResult) -> None:
        self.result = result
        for fn in self.callbacks:
            fn()

    def close(self, death_sig=None, timeout: float = 0) -> None:
        if self.result is None:
            self.end(RunProcsResult(stopped=dict.fromkeys(range(NPROCS), -15)))


def samples_of(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of ``name`` in an exposition, by their labels."""
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
            found[labels] = float(match.group(2))
    return found


def test_a_scrape_reads_steps_rates_states_and_stragglers() -> None:
    spec = WorkerSpec(
        role="trainer", local_world_size=NPROCS, rdzv_handler=Handler(), entrypoint="/bin/true"
    )
    group = WorkerGroup(spec)
    group.join(spec.rdzv_handler.next_rendezvous())
    began = time.time()
    progress = {0: Progress(40, 100, began, "", 1), 1: Progress(7, 100, began - 2, "", 1)}
    context = Context()
    sampler = Sampler(tick=0.0)  # every scrape reads the ranks anew
    channel = SimpleNamespace(
        slots=NPROCS, progress=progress.get, liveness=lambda rank: None, section_times=lambda r: {}
    )
    sampler.watch(channel, context)  # type: ignore[arg-type]
    reporter = NodeReporter(1.5)
    reporter.start(Group("host-a", 0, 1, {0: 0, 1: 1}, sampler.take), None)
    reporter.stop()  # its thread is not needed: the test posts the view itself
    reporter.view = JobView(10.0, {1: 2.0}, None, None, None, began)
    context.end(RunProcsResult(failures={1: ProcessFailure(1, 5, 3, "")}, stopped={0: -15}))
    sampler.observed(context.wait(0))  # as the agent's loop does when the end wakes it
    exporter = AgentMetrics(group, reporter, sampler.latest, lambda: 1)
    exporter.restarted("worker_failed")
    exporter.joined(0.3)
    exporter.joined(2.0)
    text = exporter.render().decode()
    assert core.metric_names(text) == set(core.CATALOGUE)
    base = {("run_id", "unit"), ("node", "host-a")}

    def rank(r: int, **more: str) -> frozenset[tuple[str, str]]:
        where = {("group_rank", "0"), ("rank", str(r)), ("local_rank", str(r))}
        return frozenset(base | where | set(more.items()))

    assert samples_of(text, "relaunch_rank_step") == {rank(0): 40, rank(1): 7}
    assert samples_of(text, "relaunch_rank_straggler") == {rank(0): 0, rank(1): 1}
    states = samples_of(text, "relaunch_worker_state")
    assert states[rank(1, state="failed")] == 1 and states[rank(0, state="stopped")] == 1
    assert states[rank(0, state="running")] == 0
    since = samples_of(text, "relaunch_rank_seconds_since_last_sign")
    assert 1.9 < since[rank(1)] - since[rank(0)] < 2.1
    restarts = samples_of(text, "relaunch_group_restarts_total")
    assert restarts[frozenset(base | {("cause", "worker_failed")})] == 1
    assert restarts[frozenset(base | {("cause", "member_lost")})] == 0
    assert samples_of(text, "relaunch_rendezvous_rounds_total") == {frozenset(base): 2}
    assert samples_of(text, "relaunch_rendezvous_duration_seconds_count") == {frozenset(base): 2}
    buckets = samples_of(text, "relaunch_rendezvous_duration_seconds_bucket")
    assert buckets[frozenset(base | {("le", "0.5")})] == 1
    assert buckets[frozenset(base | {("le", "+Inf")})] == 2
    assert samples_of(text, "relaunch_restarts_used") == {frozenset(base): 1}
    assert samples_of(text, "relaunch_store_round_trip_seconds") == {}  # one node: no store


def scrape(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", ""


def test_a_running_agent_serves_its_restarts_and_rounds_over_http(tmp_path) -> None:
    contexts: list[Context] = []

    def start_processes(**kwargs) -> Context:
        context = Context()
        contexts.append(context)
        if len(contexts) == 1:  # the first attempt fails, the second runs
            context.end(RunProcsResult(failures={1: ProcessFailure(1, 5, 3, "")}))
        return context

    spec = WorkerSpec(
        role="trainer",
        local_world_size=NPROCS,
        rdzv_handler=Handler(),
        entrypoint="/bin/true",
        max_restarts=1,
    )
    agent = LocalElasticAgent(
        spec,
        log_dir=str(tmp_path),
        start_processes=start_processes,
        metrics_port=0,
        metrics_host="127.0.0.1",
    )
    port = agent.metrics_port_bound
    assert port
    runner = threading.Thread(target=agent.run)
    runner.start()
    try:
        wait_until(lambda: len(contexts) == 2, what="the second attempt")
        status, content_type, text = scrape(port)
        assert status == 200 and content_type == core.CONTENT_TYPE
        restarts = samples_of(text, "relaunch_group_restarts_total")
        assert (
            restarts[
                frozenset({("run_id", "unit"), ("node", "host-a"), ("cause", "worker_failed")})
            ]
            == 1
        )
        assert list(samples_of(text, "relaunch_rendezvous_rounds_total").values()) == [2]
        states = samples_of(text, "relaunch_group_state")
        assert [dict(labels)["state"] for labels, v in states.items() if v == 1] == ["HEALTHY"]
        assert scrape(port, "/nothing")[0] == 404
        assert scrape(port, "/")[0] == 200
    finally:
        wait_until(lambda: contexts, what="a context")
        contexts[-1].end(RunProcsResult(return_values=dict.fromkeys(range(NPROCS))))
        runner.join(10)
    assert not runner.is_alive()
    with pytest.raises(OSError):  # the server closed with the run
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# -- the flag and the port -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("9100", ("", 9100)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        (":9100", ("", 9100)),
        ("[::1]:9100", ("::1", 9100)),
    ],
)
def test_the_flag_takes_a_port_or_an_address_and_a_port(text, expected) -> None:
    args = cli.build_parser({}).parse_args(["--metrics-port", text, "job.py"])
    assert args.metrics_port == expected
    assert cli.build_parser({"PET_METRICS_PORT": text}).parse_args(["job.py"]).metrics_port == (
        expected
    )
    assert cli.build_parser({}).parse_args(["job.py"]).metrics_port is None


@pytest.mark.parametrize("text", ["abc", "70000", "host", "1.2.3.4:x"])
def test_a_bad_metrics_port_is_a_usage_error(text, capsys) -> None:
    assert cli.main(["--metrics-port", text, "job.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--metrics-port" in err


def test_a_port_in_use_is_a_one_line_usage_error(tmp_path, capsys) -> None:
    job = tmp_path / "job.py"
    job.write_text("")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = cli.main(["--metrics-port", f"127.0.0.1:{port}", str(job)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--metrics-port 127.0.0.1:{port}: cannot serve metrics there" in err
    assert "Address already in use" in err and "Traceback" not in err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        exporter = AgentMetrics(None, None, lambda: None, lambda: 0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="give another port"):
            exporter.bind("127.0.0.1", taken.getsockname()[1])


# -- the dashboard -------------------------------------------------------------------------------


def dashboard_expressions(node: object) -> list[str]:
    """Every PromQL expression of a dashboard: its targets' ``expr`` and its variables'
    ``definition``."""
    if isinstance(node, list):
        return [found for item in node for found in dashboard_expressions(item)]
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        if key in ("expr", "definition") and isinstance(value, str):
            found.append(value)
        else:
            found.extend(dashboard_expressions(value))
    return found


def test_the_grafana_dashboard_is_json_and_uses_only_metrics_the_agent_serves() -> None:
    model = json.loads(DASHBOARD.read_text())
    assert model["title"] and model["panels"] and model["schemaVersion"] >= 30
    expressions = dashboard_expressions(model)
    assert len(expressions) >= 8
    histograms = {name for name, (kind, _) in core.CATALOGUE.items() if kind == "histogram"}
    served = set(core.CATALOGUE)
    used = set()
    for expression in expressions:
        for name in re.findall(r"\brelaunch_[a-z_]+", expression):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            used.add(base if base in histograms else name)
    assert used, expressions
    assert used <= served, used - served
    # Every metric of the catalogue has a panel.
    assert served - used == set(), served - used
