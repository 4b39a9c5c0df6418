"""The culprit verdict (``core.run.culprit``), table-tested on real stacks: faulthandler dumps
relaunch took on hangs of ``tests/integration/culprit_worker.py`` (torch 2.13 gloo: rank 2 in
its data loader while ranks 0, 1, 3 wait in a collective; plain Python: ranks waiting on a
socket, a helper thread beside), kept in ``tests/unit/stacks/``, and a binary's stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.core.run.culprit import Frame, Place, decode, encode, place_of, verdict

STACKS = Path(__file__).parent / "stacks"


def dumps(case: str) -> dict[int, str]:
    return {rank: (STACKS / case / f"rank{rank}.txt").read_text() for rank in range(4)}


def places(case: str) -> dict[int, Place | None]:
    return {rank: place_of(text) for rank, text in dumps(case).items()}


LOADER = "load_next_batch (culprit_worker.py:20)"


@pytest.mark.parametrize(
    ("case", "line"),
    [
        (
            "torch_all_reduce",
            "rank 2 did not reach the collective that ranks 0, 1, 3 wait in (all_reduce): "
            f"it is in {LOADER}",
        ),
        (
            "torch_barrier",
            "rank 2 did not reach the collective that ranks 0, 1, 3 wait in (barrier): "
            f"it is in {LOADER}",
        ),
        (
            "torch_broadcast",
            "rank 2 did not reach the collective that ranks 0, 1, 3 wait in (broadcast): "
            f"it is in {LOADER}",
        ),
        (
            "python_socket",
            "rank 2 is not where ranks 0, 1, 3 wait, in wait_on_socket (culprit_worker.py:57): "
            f"it is in {LOADER}",
        ),
    ],
)
def test_the_rank_the_others_wait_for_is_named_with_its_frame(case: str, line: str) -> None:
    found = verdict(places(case))
    assert (found.culprits, found.kind, found.line) == ((2,), "culprit", line)


def test_a_place_keeps_the_collective_and_the_users_frame_not_torchs() -> None:
    assert places("torch_all_reduce")[0] == Place(
        "all_reduce", Frame("wait_in_torch", "culprit_worker.py", 43)
    )


def test_the_main_thread_is_read_not_a_helper_thread_written_before_it() -> None:
    dump = dumps("python_socket")[0]
    assert dump.index("threading.py") < dump.index("socket.py")  # the helper comes first
    assert place_of(dump) == Place("", Frame("wait_on_socket", "culprit_worker.py", 57))


def test_every_rank_in_one_collective_is_said_and_nobody_named() -> None:
    waiting = {rank: place for rank, place in places("torch_all_reduce").items() if rank != 2}
    found = verdict(waiting)
    assert (found.culprits, found.kind) == ((), "same")
    assert found.line == (
        "ranks 0, 1, 3 all wait in the same collective, "
        "all_reduce, from wait_in_torch (culprit_worker.py:43): none stands apart from the others"
    )


@pytest.mark.parametrize(
    ("first", "second", "shown"),
    [
        (
            "python_socket",
            "python_socket",
            f"ranks 0, 1: wait_on_socket (culprit_worker.py:57); ranks 2, 3: {LOADER}",
        ),
        (
            "torch_all_reduce",
            "torch_barrier",
            "ranks 0, 1: all_reduce, from wait_in_torch (culprit_worker.py:43); "
            "ranks 2, 3: barrier, from wait_in_torch (culprit_worker.py:45)",
        ),
    ],
)
def test_ranks_split_evenly_are_said_to_be_not_guessed(first: str, second: str, shown: str) -> None:
    if first == second:  # two in the loader, two waiting
        split = {0: places(first)[0], 1: places(first)[1], 2: places(first)[2], 3: places(first)[2]}
    else:  # two in one collective, two in another
        split = {
            0: places(first)[0],
            1: places(first)[1],
            2: places(second)[0],
            3: places(second)[1],
        }
    found = verdict(split)
    assert (found.culprits, found.kind) == ((), "split")
    assert found.line == (
        f"the ranks split evenly ({shown}): relaunch cannot tell which the others wait for"
    )


def test_ranks_outside_the_one_collective_are_named_even_when_as_many() -> None:
    """Ranks in a collective wait for the others: those outside it did not arrive, however many
    (a whole node stuck in its loader)."""
    torch = places("torch_all_reduce")
    found = verdict({0: torch[0], 1: torch[1], 2: torch[2], 3: torch[2]})
    assert found.culprits == (2, 3)
    assert found.line == (
        "ranks 2, 3 did not reach the collective that ranks 0, 1 wait in (all_reduce): "
        f"they are in {LOADER}"
    )


@pytest.mark.parametrize("stderr", ["", "working\n", "sh: 1: sleep: killed\n"])
def test_a_binary_gives_no_place(stderr: str) -> None:
    assert place_of(stderr) is None


def test_no_stack_at_all_is_said() -> None:
    found = verdict({0: None, 1: None})
    assert (found.culprits, found.kind) == ((), "none")
    assert found.line == (
        "no rank gave a Python stack (binary workers, or ranks that died before they could): "
        "relaunch cannot tell which rank the others wait for"
    )


def test_ranks_without_a_stack_and_nodes_not_heard_from_are_said() -> None:
    torch = places("torch_all_reduce")
    found = verdict({**torch, 3: None}, missing=[1], waited=10.0)
    assert found.culprits == (2,)
    assert found.line == (
        "rank 2 did not reach the collective that ranks 0, 1 wait in (all_reduce): "
        f"it is in {LOADER}; rank 3 gave no Python stack; "
        "node 1 sent no stacks within 10s (not counted)"
    )


def test_many_ranks_are_shown_as_runs_and_each_culprits_place_given() -> None:
    torch, plain = places("torch_all_reduce"), places("python_socket")
    job = {rank: torch[0] for rank in range(12)}
    job.update({5: torch[2], 6: torch[2], 7: torch[2], 9: plain[0]})
    found = verdict(job)
    assert found.culprits == (5, 6, 7, 9)
    assert found.line == (
        "ranks 5-7, 9 did not reach the collective that ranks 0-4, 8, 10, 11 wait in (all_reduce): "
        f"ranks 5-7 are in {LOADER}, rank 9 is in wait_on_socket (culprit_worker.py:57)"
    )


def test_places_go_through_the_store_unchanged() -> None:
    sent = {**places("torch_all_reduce"), 7: None, 9: Place("barrier")}
    assert decode(encode(sent)) == sent
