"""torchft's lighthouse, decided: when a job gets one, its settings and their overrides, its
command line, the address workers get, and the backoff of a lighthouse that keeps dying."""

from __future__ import annotations

import pytest

import relaunch.core.run.lighthouse as decide


@pytest.mark.parametrize(
    ("environ", "importable", "groups", "wanted"),
    [
        ({}, True, 2, True),
        ({}, True, 1, True),
        ({"TORCHFT_LIGHTHOUSE": "  "}, True, 2, True),  # empty: unset
        ({"TORCHFT_LIGHTHOUSE": "http://lh:29510"}, True, 2, False),  # given: used as it is
        ({}, False, 2, False),  # torchft not importable
        ({}, True, None, False),  # no replica groups
    ],
)
def test_when_a_job_gets_a_lighthouse(
    environ: dict[str, str], importable: bool, groups: int | None, wanted: bool
) -> None:
    assert decide.wants_lighthouse(environ, importable, groups) is wanted


def test_the_settings_default_to_fast_recovery() -> None:
    settings, wrong = decide.settings_from({}, min_replicas=2)
    assert wrong == []
    assert settings == decide.LighthouseSettings(2, 500, 200, 20)
    assert decide.LighthouseSettings().min_replicas == 1


def test_each_timing_is_overridden_by_its_variable_and_a_bad_value_is_said() -> None:
    environ = {
        "RELAUNCH_LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS": "3000",
        "RELAUNCH_LIGHTHOUSE_JOIN_TIMEOUT_MS": "soon",
        "RELAUNCH_LIGHTHOUSE_QUORUM_TICK_MS": "0",
    }
    settings, wrong = decide.settings_from(environ)
    assert settings == decide.LighthouseSettings(1, 3000, 200, 20)
    assert wrong == [
        "RELAUNCH_LIGHTHOUSE_JOIN_TIMEOUT_MS='soon' is not a whole number of milliseconds "
        "in 1..86400000; using 200",
        "RELAUNCH_LIGHTHOUSE_QUORUM_TICK_MS='0' is not a whole number of milliseconds "
        "in 1..86400000; using 20",
    ]


def test_min_replicas_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas >= 1"):
        decide.LighthouseSettings(0)


def test_the_command_line_has_torchft_lighthouses_flags() -> None:
    argv = decide.command("py", "prog.py", "ext.so", "127.0.0.1:0", decide.LighthouseSettings())
    assert argv == [
        "py", "-I", "-S", "prog.py", "ext.so", "--bind", "127.0.0.1:0", "--min_replicas", "1",
        "--heartbeat_timeout_ms", "500", "--join_timeout_ms", "200", "--quorum_tick_ms", "20",
    ]  # fmt: skip


def test_addresses() -> None:
    assert decide.bind_address("127.0.0.1", 29510) == "127.0.0.1:29510"
    assert decide.bind_address("::1", 29510) == "[::1]:29510"
    assert decide.worker_address("::1", 29510) == "http://[::1]:29510"
    assert decide.port_from("http://vm:34703\n") == 34703
    for line in ("", "listening", "http://vm:", "http://vm:0", "http://vm:70000", ":12"):
        assert decide.port_from(line) is None


def test_a_lighthouse_that_keeps_dying_is_restarted_ever_more_slowly() -> None:
    deaths, delays = 0, []
    for _ in range(7):
        deaths = decide.in_a_row(deaths, ran_for=0.5)
        delays.append(decide.restart_delay(deaths))
    assert delays == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 5.0]
    assert decide.in_a_row(deaths, ran_for=10.0) == 1  # ran a healthy while: a new count
    assert decide.restart_delay(1) == 0.0


def test_the_death_and_back_lines() -> None:
    line = decide.death_line(7, "killed by SIGKILL (signal 9)", 0.0, 1)
    assert (
        line == "torchft's lighthouse (pid 7) killed by SIGKILL (signal 9); restarting it at once"
    )
    line = decide.death_line(7, "exited with code 1", 0.5, 3)
    assert line.endswith("restarting it in 0.5s (3 deaths in a row)")
    assert decide.back_line("http://127.0.0.1:5", 0.0712, 9) == (
        "torchft's lighthouse is back on http://127.0.0.1:5 after 0.071s, its quorum ids past 9"
    )
    assert decide.back_line("http://127.0.0.1:5", 0.05, 0) == (
        "torchft's lighthouse is back on http://127.0.0.1:5 after 0.05s"
    )


def test_the_lighthouses_address_goes_through_the_store_as_host_and_port() -> None:
    assert decide.announcement("10.0.0.2", 29510) == b"10.0.0.2:29510"
    assert decide.target_from(b"10.0.0.2:29510") == (("10.0.0.2", 29510), None)
    assert decide.target_from(decide.announcement("::1", 7)) == (("::1", 7), None)
    assert decide.target_from(b"node-3.cluster:80") == (("node-3.cluster", 80), None)
    assert decide.target_from(None) == (None, None)
    assert decide.target_from(b"") == (None, None)


@pytest.mark.parametrize(
    "forged",
    [b"nohost", b":29510", b"h:0", b"h:65536", b"h:123456", b"h:-1", b"h:1e3", b"h o:1",
     b"h\n:1", b"[[x]]:1", b"\xff\xfe:1", b"h" * 400 + b":1"],
)  # fmt: skip
def test_a_forged_address_in_the_store_is_no_target(forged: bytes) -> None:
    target, wrong = decide.target_from(forged)
    assert target is None
    assert wrong is not None and wrong.startswith(
        "the lighthouse's address in the store is no HOST:PORT: "
    )
    assert "\n" not in wrong and len(wrong) < 140


def test_workers_retry_a_quorum_every_half_second_unless_told() -> None:
    given = decide.worker_defaults({})
    # torchft sleeps its quorum timeout (60 s unless set) / (retries + 1) between tries
    assert 60_000 // (int(given["TORCHFT_QUORUM_RETRIES"]) + 1) == 500
    assert decide.worker_defaults({"TORCHFT_QUORUM_RETRIES": "3"}) == {}


def test_a_torchft_job_that_restarts_cold_is_told_how_to_restart_warm() -> None:
    hint = decide.warm_hint(())
    assert hint is not None and "--preload torch,torch._dynamo,torchft" in hint
    assert decide.warm_hint(("torch",)) is None  # the user chose what to preload


#: Two quorums as torchft 0.2.0's lighthouse logs them (one line each; cut short here).
LOG = (
    "2026-11-29T06:40:32.956 [INFO] [torchft::lighthouse] - Quorum! Quorum { quorum_id: 1, "
    'participants: [QuorumMember { replica_id: "train_0:87c2", address: "http://vm:37961" }] }\n'
    "2026-11-29T06:40:33.001 [INFO] [torchft::lighthouse] - Received quorum request for x\n"
    "2026-11-29T06:40:33.002 [INFO] [torchft::lighthouse] - Quorum! Quorum { quorum_id: 2, "
    'participants: [QuorumMember { replica_id: "train_0:87c2", address: "http://vm:37961" }, '
    'QuorumMember { replica_id: "train_1:9e2d", address: "http://vm:43091" }] }\n'
    "2026-11-29T06:40:33.010 [INFO] [torchft::lighthouse] - Quorum status: not ready\n"
)


def test_a_restarted_lighthouse_passes_the_last_quorum_id_with_its_groups() -> None:
    past, groups = decide.last_quorum(LOG)
    assert (past, groups) == (2, ["train_0:87c2", "train_1:9e2d"])
    assert decide.last_quorum("Lighthouse listening on: http://vm:1\n") == (0, [])
    assert decide.last_quorum(LOG[: LOG.index("replica_id")]) == (0, [])  # cut: none
    assert decide.last_quorum("Quorum! Quorum { quorum_id: x, ") == (0, [])
    settings = decide.LighthouseSettings()
    argv = decide.command("py", "prog.py", "ext.so", "h:1", settings, groups, past)
    assert argv[-6:] == [
        "--past_quorum", "2", "--heartbeat", "train_0:87c2", "--heartbeat", "train_1:9e2d",
    ]  # fmt: skip
    assert "--past_quorum" not in decide.command("py", "prog.py", "ext.so", "h:1", settings)
