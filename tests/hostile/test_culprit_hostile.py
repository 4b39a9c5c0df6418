"""A hang's places sent by other nodes (``agent.culprit``, ``core.run.culprit.decode``): they come
from other hosts through the store, so an oversized, malformed or escape-laden part is refused in
one warning and counted as a node that sent nothing; the verdict is given over the rest, and a
node whose part never comes is named once the deadline passes, rather than waited for."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from relaunch.agent.culprit import NOTE, job_verdict
from relaunch.core.run.culprit import (
    MAX_BYTES,
    MAX_NAME,
    MAX_RANKS,
    Place,
    decode,
    encode,
    place_of,
)
from relaunch.rendezvous.job import SoloJob
from relaunch.store.api import StoreError
from relaunch.store.memory import MemoryStore

STACKS = Path(__file__).parent.parent / "unit" / "stacks" / "torch_all_reduce"


def place(rank: int) -> Place | None:
    return place_of((STACKS / f"rank{rank}.txt").read_text())


class StoreJob(SoloJob):
    """A node of a job of several whose notes are in a real (in-process) store, as the dynamic
    job keeps them: each part under ``notes/NAME/MEMBER``."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # no handler: notes only
        self.store = store

    def gather(
        self, name: str, rank: int, count: int, value: bytes, timeout: float
    ) -> dict[int, bytes] | None:
        keys = [f"notes/{name}/{member}" for member in range(count)]
        self.store.set(keys[rank], value)
        try:
            self.store.wait(keys, timeout)
        except (StoreError, TimeoutError):
            return None
        return {member: self.store.get(key).value or b"" for member, key in enumerate(keys)}

    def read_notes(self, names: Sequence[str]) -> dict[str, bytes]:
        found = {name: self.store.get(f"notes/{name}").value for name in names}
        return {name: value for name, value in found.items() if value is not None}


HOSTILE = [
    pytest.param(b"x" * (MAX_BYTES + 1), "bytes, more than", id="oversized"),
    pytest.param(b"\xff\xfe{", "not JSON", id="not-utf8"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "not JSON", id="deeply-nested"),
    pytest.param(b'{"ranks": []}', "not a map", id="ranks-not-a-map"),
    pytest.param(json.dumps({"ranks": {"-1": None}}).encode(), "not a rank", id="negative-rank"),
    pytest.param(json.dumps({"ranks": {"1e9": None}}).encode(), "not a rank", id="float-rank"),
    pytest.param(
        json.dumps({"ranks": {str(r): None for r in range(MAX_RANKS + 1)}}).encode(),
        "not a map of at most",
        id="too-many-ranks",
    ),
    pytest.param(
        json.dumps({"ranks": {"2": ["", "f\x1b[2J", "x.py", 1]}}).encode(),
        "printable",
        id="escape-sequence",
    ),
    pytest.param(
        json.dumps({"ranks": {"2": ["", "f" * (MAX_NAME + 1), "x.py", 1]}}).encode(),
        "printable",
        id="long-name",
    ),
    pytest.param(json.dumps({"ranks": {"2": ["", "f", "x.py", -5]}}).encode(), "line", id="line"),
    pytest.param(json.dumps({"ranks": {"2": ["", "f", "x.py"]}}).encode(), "a place", id="short"),
    pytest.param(json.dumps({"ranks": {"2": {"f": 1}}}).encode(), "a place", id="dict"),
]


@pytest.mark.parametrize(("data", "said"), HOSTILE)
def test_a_hostile_part_is_refused_in_one_line(data: bytes, said: str) -> None:
    began = time.monotonic()
    with pytest.raises(ValueError, match=said) as caught:
        decode(data)
    assert time.monotonic() - began < 1.0
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)


@pytest.mark.parametrize(("data", "said"), HOSTILE[:3] + HOSTILE[7:8])
def test_a_nodes_hostile_part_is_not_counted_and_the_verdict_is_given_over_the_rest(
    data: bytes, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    store.set(f"notes/{NOTE}/1", data)  # node 1's part, from another host
    found = job_verdict(StoreJob(store), 0, 3, {0: place(0), 1: place(1), 2: place(2)}, 0.2)
    # node 2's part never came: named too, after the deadline
    assert found.culprits == (2,)
    assert found.line.endswith("; nodes 1, 2 sent no stacks within 0.2s (not counted)")
    assert "node 1 sent its ranks' places unreadable" in caplog.text
    assert "\x1b" not in caplog.text


def test_every_nodes_part_gives_one_verdict_on_every_node() -> None:
    store = MemoryStore()
    parts = [{0: place(0), 1: place(1)}, {2: place(2), 3: place(3)}]
    store.set(f"notes/{NOTE}/1", encode(parts[1]))
    began = time.monotonic()
    found = job_verdict(StoreJob(store), 0, 2, parts[0], 5.0)
    assert time.monotonic() - began < 1.0  # every part there: no wait
    assert found.culprits == (2,) and "sent no stacks" not in found.line
    assert job_verdict(StoreJob(store), 1, 2, parts[1], 5.0) == found
