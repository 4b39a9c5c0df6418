"""torchft's lighthouse under relaunch, decided: whether a job gets one, its settings, its
command line, and how fast it is restarted when it keeps dying.

torchft's replica groups agree on each step's quorum through one lighthouse. relaunch starts
one where torchft is importable, the job has replica groups and ``TORCHFT_LIGHTHOUSE`` is unset
(a given one is used as it is), and restarts it when it dies, behind the address the workers
were given (a relay), its quorum ids past the last one its predecessor gave (``last_quorum``).

Its settings are matched to how fast relaunch restarts a group (well under a second). Measured
with torchft 0.2.0's own client, two groups heartbeating every 100 ms and one of them gone: the
survivor's next quorum came 5.00 s later with torchft's defaults, 1.01 s with a 1000 ms
heartbeat timeout and 0.51 s with 500 ms. A dead group's last incarnation counts as alive until
its heartbeats are that old (each incarnation has its own replica id). With two groups the
survivor alone is not more than half of the groups that heartbeat (torchft's split-brain rule),
so it waits until the dead one's heartbeats time out or the new incarnation asks too, then for
the join timeout since the survivor asked; with three or more, for the shorter of the two
timeouts. relaunch restarts a failed group at once, so with ``--preload`` the new incarnation
asks before either timeout and the others wait for it rather than for a timeout.

- ``heartbeat_timeout_ms`` 500 (torchft's default 5000): a torchft ``Manager`` heartbeats every
  100 ms (``heartbeat_interval``) from its Rust server's thread, which a busy Python step does
  not hold up, so five heartbeats in a row must go missing before a group counts as gone; a
  healthy group dropped by mistake only joins the next step's quorum and heals. None was, in
  2 and 3 groups of 150 steps each beside two and four CPU hogs on two cores.
- ``join_timeout_ms`` 200 (torchft's default 60000): a quorum waits at most this long for a
  group that heartbeats but has not asked yet. A failed group's dead incarnation heartbeats for
  ``heartbeat_timeout_ms`` after its death, so this is what the other groups wait when the
  failed one is slow, and what they wait at most when it comes back warm (``--preload``: it asks
  0.2-0.3 s after the kill): 0.55 s with 500, 0.29-0.32 s with 200 (2 and 3 groups). A group
  that asks later than this in a healthy step (a straggler, 3 groups or more) is left out of
  that step and heals into the next: the requests of one round came within 7 ms of each other
  (median; 73 ms at most over 149 rounds, 3 groups beside four CPU hogs on two cores).
- ``quorum_tick_ms`` 20 (torchft's default 100): how often a waiting quorum is looked at again;
  a cheap timer in one process, it adds at most 20 ms to a quorum instead of 100.

Each is overridden by its ``RELAUNCH_LIGHTHOUSE_*`` variable (a whole number of milliseconds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from relaunch.core.durations import seconds
from relaunch.core.run.restart import Backoff
from relaunch.core.value import Value

#: The variable torchft's ``Manager`` reads the lighthouse's address from.
ADDRESS_VAR = "TORCHFT_LIGHTHOUSE"
#: How many replica groups make a quorum unless the job says: one, so a lone survivor goes on.
MIN_REPLICAS = 1
HEARTBEAT_TIMEOUT_MS = 500
JOIN_TIMEOUT_MS = 200
QUORUM_TICK_MS = 20
#: torchft's variable for how often a ``Manager`` tries a quorum again when the lighthouse did
#: not answer (torchft's default: 0, and every group crashes), and what relaunch gives the
#: workers unless it is set. torchft sleeps the quorum timeout / (retries + 1) between tries
#: (at least 100 ms), so that the tries span about the quorum timeout: with 5 and torchft's
#: 60 s, 10 s, which a lighthouse restarted in 0.03-0.08 s cost every group. With 119, 0.5 s:
#: by then every live group's heartbeats (every 100 ms) reach the restarted lighthouse, so its
#: first quorum waits for them all. With 599 (0.1 s) the first group to try again was alone in
#: it, took quorum id 1 again (a restarted lighthouse counts from 1) and did not reconfigure,
#: and its next all-reduce waited on a group no longer in its quorum until gloo's timeout.
QUORUM_RETRIES_VAR = "TORCHFT_QUORUM_RETRIES"
QUORUM_RETRIES = 119
#: Each setting, its default and the variable that overrides it.
OVERRIDES = {
    "heartbeat_timeout_ms": ("RELAUNCH_LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS", HEARTBEAT_TIMEOUT_MS),
    "join_timeout_ms": ("RELAUNCH_LIGHTHOUSE_JOIN_TIMEOUT_MS", JOIN_TIMEOUT_MS),
    "quorum_tick_ms": ("RELAUNCH_LIGHTHOUSE_QUORUM_TICK_MS", QUORUM_TICK_MS),
}
#: The largest value a setting takes (a day): torchft reads them as unsigned 64-bit numbers.
MAX_MS = 86_400_000
#: Restarts of a lighthouse that keeps dying: the first at once, then 0.25 s before the second
#: in a row, doubling up to 5 s; one that ran 10 s before it died starts the count again.
RESTART_BACKOFF = Backoff(base=0.25, cap=5.0, healthy=10.0)
#: At this many deaths in a row, the first lines of its log are shown with the death.
SHOW_LOG_AFTER = 3
#: How many of those lines.
LOG_LINES = 5
#: Seconds a (re)started lighthouse has to say it listens before it counts as dead.
START_TIMEOUT = 30.0


class LighthouseSettings(Value):
    """What a lighthouse is started with: the replica groups a quorum needs, and its three
    timings in milliseconds."""

    __slots__ = ("heartbeat_timeout_ms", "join_timeout_ms", "min_replicas", "quorum_tick_ms")

    min_replicas: int
    heartbeat_timeout_ms: int
    join_timeout_ms: int
    quorum_tick_ms: int

    def __init__(
        self,
        min_replicas: int = MIN_REPLICAS,
        heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
        join_timeout_ms: int = JOIN_TIMEOUT_MS,
        quorum_tick_ms: int = QUORUM_TICK_MS,
    ) -> None:
        if min_replicas < 1:
            raise ValueError(f"a lighthouse needs min_replicas >= 1, got {min_replicas}")
        self._set(
            min_replicas=min_replicas,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
        )


def wants_lighthouse(
    environ: Mapping[str, str], torchft_importable: bool, replica_groups: int | None
) -> bool:
    """Whether relaunch starts a lighthouse: the job has replica groups (``replica_groups`` not
    None), torchft is importable and ``TORCHFT_LIGHTHOUSE`` is unset or empty."""
    given = environ.get(ADDRESS_VAR, "").strip()
    return replica_groups is not None and torchft_importable and not given


def worker_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What the workers of a job whose lighthouse relaunch keeps get besides its address: the
    quorum's retries, unless set already (a restarted lighthouse must not crash every group)."""
    if environ.get(QUORUM_RETRIES_VAR, "").strip():
        return {}
    return {QUORUM_RETRIES_VAR: str(QUORUM_RETRIES)}


#: What a torchft job's workers import before their first step (``torch._dynamo``: torch's
#: ``DistributedDataParallel`` imports it as it is built, 1.2 s here), to preload.
WARM_MODULES = ("torch", "torch._dynamo", "torchft")


def warm_hint(preload: tuple[str, ...]) -> str | None:
    """The line said to a torchft job whose workers would restart cold (``preload``: the job's
    ``--preload``, empty), None when they restart warm. Not turned on for the user: a preloaded
    worker is forked from a process that imported torch (docs/preload.md says what it sees),
    and the groups' program need not be torchft's because torchft is installed."""
    if preload:
        return None
    return (
        "a failed group's workers restart cold, importing torch again (3 to 5 s before it "
        f"steps again); --preload {','.join(WARM_MODULES)} restarts them warm (0.3 s)"
    )


def settings_from(
    environ: Mapping[str, str], min_replicas: int = MIN_REPLICAS
) -> tuple[LighthouseSettings, list[str]]:
    """The settings, each timing from its ``RELAUNCH_LIGHTHOUSE_*`` variable where set, and one
    line for each variable that is not a whole number of milliseconds in 1..MAX_MS (its
    default is used then)."""
    values: dict[str, int] = {}
    wrong: list[str] = []
    for field, (var, default) in OVERRIDES.items():
        text = environ.get(var, "").strip()
        values[field] = default
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = 0
        if 1 <= value <= MAX_MS:
            values[field] = value
        else:
            wrong.append(
                f"{var}={text!r:.40} is not a whole number of milliseconds in 1..{MAX_MS}; "
                f"using {default}"
            )
    return LighthouseSettings(min_replicas, **values), wrong


def command(
    python: str,
    program: str,
    extension: str,
    bind: str,
    settings: LighthouseSettings,
    heartbeats: Sequence[str] = (),
    past_quorum: int = 0,
) -> list[str]:
    """The lighthouse's command line: relaunch's ``program`` run by path in an isolated
    ``python`` (no site, no user paths), loading torchft's ``extension`` by its path and
    serving on ``bind`` (``HOST:PORT``; port 0: a free one) with the flags of
    ``torchft_lighthouse``; a restart's also with the last quorum its predecessor logged
    (``last_quorum``): its id, ``past_quorum``, which the new one's quorum ids must pass before
    anyone else reaches it, and its replica ids, ``heartbeats``, the groups its first quorum
    waits for (``--past_quorum ID --heartbeat REPLICA_ID...``)."""
    return [
        python,
        "-I",
        "-S",
        program,
        extension,
        "--bind",
        bind,
        "--min_replicas",
        str(settings.min_replicas),
        "--heartbeat_timeout_ms",
        str(settings.heartbeat_timeout_ms),
        "--join_timeout_ms",
        str(settings.join_timeout_ms),
        "--quorum_tick_ms",
        str(settings.quorum_tick_ms),
        *(("--past_quorum", str(past_quorum)) if past_quorum > 0 else ()),
        *(part for replica in heartbeats for part in ("--heartbeat", replica)),
    ]


#: How much of the end of the lighthouse's log is read for its last quorum.
LOG_TAIL_BYTES = 1 << 20
#: The most replica ids taken from it.
MAX_PARTICIPANTS = 4096
#: How torchft's lighthouse logs a quorum it made: one line, each member's replica id in it.
_QUORUM_MARK = "Quorum! Quorum {"
_REPLICA_RE = re.compile(r'replica_id: "([^"\\\s]{1,256})"')
_QUORUM_ID_RE = re.compile(r" quorum_id: (\d{1,18}),")


def last_quorum(log_tail: str) -> tuple[int, list[str]]:
    """The id and the replica ids of the last quorum a lighthouse's log (its end, ``log_tail``)
    shows; ``(0, [])`` when it shows none (or only part of one).

    A restarted torchft 0.2.0 lighthouse numbers its quorums from 1 again, and torchft's
    ``Manager`` names each quorum's store prefix by its id (``torchft/<id>/``): groups whose
    quorum changed would reconfigure into a prefix an earlier quorum used, where gloo reads a
    dead peer's address (with 3 groups, every group crashed in 1 run of 4), and a group whose
    quorum had the new one's id would not reconfigure at all. So the new lighthouse is driven
    past this id before the workers reach it. And it knows no group until each heartbeats
    (every 100 ms): the first to ask would make a quorum alone; the replica ids of the last
    quorum heartbeat as it starts, so that its first quorum waits for every group of it."""
    at = log_tail.rfind(_QUORUM_MARK)
    if at < 0:
        return 0, []
    line = log_tail[at:].split("\n", 1)[0]
    number = _QUORUM_ID_RE.match(line, len(_QUORUM_MARK))
    replicas = list(dict.fromkeys(_REPLICA_RE.findall(line)))[:MAX_PARTICIPANTS]
    if number is None or not replicas:
        return 0, []  # cut short: nothing to go on
    return int(number.group(1)), replicas


def bind_address(host: str, port: int) -> str:
    """``HOST:PORT`` as the lighthouse binds it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_address(host: str, port: int) -> str:
    """The ``TORCHFT_LIGHTHOUSE`` workers are given: ``http://HOST:PORT``."""
    return f"http://{bind_address(host, port)}"


def port_from(line: str) -> int | None:
    """The port in the line the lighthouse's program says once it listens (its address,
    ``http://NAME:PORT``); None when the line is no such address."""
    head, colon, tail = line.strip().rpartition(":")
    if not colon or not head or not tail.isdigit():
        return None
    port = int(tail)
    return port if 0 < port < 65536 else None


def in_a_row(previous: int, ran_for: float, backoff: Backoff = RESTART_BACKOFF) -> int:
    """The deaths in a row after one that came ``ran_for`` seconds after its start, given
    ``previous`` ones before it (a lighthouse that ran the backoff's healthy time starts
    again at one)."""
    return 1 if ran_for >= backoff.healthy else previous + 1


def restart_delay(deaths_in_a_row: int, backoff: Backoff = RESTART_BACKOFF) -> float:
    """Seconds to wait before restarting a lighthouse that died ``deaths_in_a_row`` times in a
    row: none the first time."""
    return backoff.delay(deaths_in_a_row)


def death_line(pid: int, how: str, delay: float, deaths: int) -> str:
    """The one line said when the lighthouse died, ``how`` (``killed by SIGKILL``, ``exited
    with status 1``)."""
    again = "at once" if delay == 0 else f"in {seconds(delay)} ({deaths} deaths in a row)"
    return f"torchft's lighthouse (pid {pid}) {how}; restarting it {again}"


def back_line(address: str, back: float, past_quorum: int) -> str:
    """The one line said when a restarted lighthouse serves again, at ``address`` (what the
    workers reach), ``back`` seconds after the death, its quorum ids past ``past_quorum``."""
    line = f"torchft's lighthouse is back on {address} after {seconds(back)}"
    return f"{line}, its quorum ids past {past_quorum}" if past_quorum > 0 else line


# -- several nodes: where the lighthouse is now, in the store ---------------------------------

#: The job's key (``rendezvous.rounds.job_key(run_id, KEY_NAME)``) where the node that runs
#: the lighthouse writes its address; every node's relay follows it.
KEY_NAME = "lighthouse"
#: The longest address a relay takes from the store.
MAX_ANNOUNCEMENT = 300
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]")


def announcement(host: str, port: int) -> bytes:
    """What the lighthouse's node writes under ``KEY_NAME``: ``HOST:PORT``."""
    return bind_address(host, port).encode()


def target_from(value: bytes | None) -> tuple[tuple[str, int] | None, str | None]:
    """The lighthouse's ``(host, port)`` read from the store's ``value`` (None: none yet), and
    what is wrong with a value that is no such address (then no target)."""
    if value is None or not value:
        return None, None
    text = value.decode("ascii", errors="replace")
    head, colon, tail = text.rpartition(":")
    host = head[1:-1] if head.startswith("[") and head.endswith("]") else head
    port = int(tail) if tail.isdigit() and len(tail) <= 5 else 0
    if (
        len(value) > MAX_ANNOUNCEMENT
        or not colon
        or not host
        or not set(host) <= _HOST_CHARS
        or "[" in host
        or not 0 < port < 65536
    ):
        return None, f"the lighthouse's address in the store is no HOST:PORT: {text[:60]!r}"
    return (host, port), None
