"""The pure rules of kept state (``relaunch.core.workers.state``): which step a world resumes from,
the slot header, the memory bound's arithmetic."""

from __future__ import annotations

import pytest

from relaunch.core.workers import state, state_settings


def test_a_world_resumes_from_the_newest_step_every_rank_has() -> None:
    assert state.common_step({0: [4, 5], 1: [3, 4]}, 2) == 4
    assert state.common_step({0: [5], 1: [4]}, 2) is None  # nothing common: start afresh
    assert state.common_step({0: [4, 5]}, 2) is None  # rank 1 has nothing
    assert state.common_step({0: [7], 1: [7], 2: [7]}, 3) == 7
    assert state.common_step({}, 0) is None


def test_a_replicated_save_stands_for_every_rank_of_its_node() -> None:
    own = state.read_header(state.header(4, 9, [10], committed=True))
    shared = state.read_header(state.header(6, 3, [10], committed=True, flags=state.REPLICATED))
    assert own is not None and shared is not None
    assert state.steps_held({0: [shared], 1: [own]}) == {0: [6], 1: [4, 6]}


def test_only_a_committed_header_is_read() -> None:
    written = state.header(12, 3, [100, 5, 7], committed=True)
    head = state.read_header(written)
    assert head is not None
    assert (head.step, head.generation, head.parts) == (12, 3, 3)
    # The table ends at 88; the parts start at 128, 256 and 320 (each at a multiple of 64),
    # and the slot ends at 327.
    assert state.part_offsets([100, 5, 7]) == [128, 256, 320, 327]
    assert head.size == 327
    assert state.read_header(state.header(12, 3, [100], committed=False)) is None
    assert state.read_header(bytes(64)) is None
    assert state.read_header(written[:20]) is None


@pytest.mark.parametrize(
    ("text", "size"),
    [("512M", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29), ("4096", 4096), ("2k", 2048)],
)
def test_sizes_read_as_people_write_them(text: str, size: int) -> None:
    assert state_settings.parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "1.2.3M", "5X"])
def test_a_size_that_is_not_one_says_how_to_write_it(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|more than 0"):
        state_settings.parse_bytes(text)


def test_a_save_that_does_not_fit_says_how_much_and_what_to_do() -> None:
    assert state.too_large(100, 50, 150) is None
    line = state.too_large(8 << 20, 1 << 20, 4 << 20)
    assert line is not None and "\n" not in line
    assert "needs 8 MiB" in line and "holds 4 MiB" in line and "1 MiB in use" in line
    assert "--state-memory" in line


def test_settings_are_checked_once() -> None:
    with pytest.raises(ValueError, match="state_persist_every"):
        state_settings.StateSettings(persist_every=0)
    with pytest.raises(ValueError, match="jit_save_timeout"):
        state_settings.StateSettings(jit_save_timeout=-1)
    with pytest.raises(ValueError, match="state memory"):
        state_settings.StateSettings(memory=0)
    for replicas in (-1, True, 1.5):
        with pytest.raises(ValueError, match="state_replicas"):
            state_settings.StateSettings(replicas=replicas)  # type: ignore[arg-type]
    for every in (0, True, 1.5):
        with pytest.raises(ValueError, match="state_copy_every"):
            state_settings.StateSettings(copy_every=every)  # type: ignore[arg-type]
    assert state_settings.default_memory(16 << 30) == 4 << 30


def test_a_node_copies_its_state_to_the_next_nodes_in_ring_order_never_to_itself() -> None:
    assert state.successors(0, 4, 1) == [1]
    assert state.successors(3, 4, 2) == [0, 1]
    assert state.successors(1, 3, 5) == [2, 0]  # as many as there are other nodes
    assert state.successors(0, 1, 1) == []  # alone
    assert state.successors(2, 4, 0) == []  # --state-replicas 0: no copies


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        b"[]",
        b'{"address": 1, "held": {}}',
        b'{"address": "a:1", "held": {"x": [1]}}',
        b'{"address": "a:1", "held": {"0": [true]}}',
        b'{"address": "a:1", "held": {"0": "1"}}',
        b'{"address": "a:1", "held": {}, "replicated": ["1"]}',
        b'{"address": "a:1", "held": {}, "runs": [0.5]}',
    ],
)
def test_a_state_record_from_the_store_is_checked_before_it_is_used(raw: bytes) -> None:
    from relaunch.core.workers.state_agreement import node_held

    with pytest.raises(ValueError):
        node_held(raw)


def test_a_state_record_reads_as_its_peer_and_steps() -> None:
    from relaunch.core.workers.state_agreement import node_held

    raw = b'{"address": "10.0.0.2:4000", "held": {"3": [7, 8]}, "replicated": [8], "runs": [3]}'
    assert node_held(raw) == ("10.0.0.2:4000", {3: [7, 8]}, [8], [3])
    alone = node_held(b'{"address": null, "held": {"3": [7]}, "runs": [3]}')  # no token: no copies
    assert alone.address is None and alone.reaches(3, alone) and not alone.reaches(4, None)
    served = node_held(b'{"address": "10.0.0.2:4000", "held": {"4": [7]}, "runs": [3]}')
    assert served.reaches(4, None) and served.reaches(3, alone) and not served.reaches(4, alone)


def saves_kept(copy_every: int, steps: range) -> list[dict[int, state.Header]]:
    """A rank's committed slots after each save of ``steps``, slots chosen by
    ``slot_to_write``."""
    slots: dict[int, state.Header] = {}
    after = []
    for generation, step in enumerate(steps, start=1):
        slot = state.slot_to_write(slots, copy_every)
        slots.pop(slot, None)  # uncommitted while it is written
        slots[slot] = state.Header(step, generation, 1, 8, 0)
        after.append(dict(slots))
    return after


def test_a_save_goes_to_the_other_of_two_slots_when_every_step_is_copied() -> None:
    kept = saves_kept(1, range(1, 8))
    assert [sorted(slots) for slots in kept][-1] == [0, 1]
    for step, slots in enumerate(kept, start=1):
        assert {head.step for head in slots.values()} == {step, step - 1} - {0}


def test_with_copy_steps_a_rank_keeps_its_newest_save_and_its_two_newest_copy_steps() -> None:
    """``--state-copy-every 4``: besides the newest save and the one before it (a save cut
    short leaves it), the two newest saves of multiples of 4, which other nodes copy: what a
    node's loss resumes from, whoever's copy trailed. Never more than four slots."""
    for step, slots in enumerate(saves_kept(4, range(1, 30)), start=1):
        steps = {head.step for head in slots.values()}
        copies = [s for s in range(step, 0, -1) if s % 4 == 0][:2]
        assert {step, step - 1} - {0} <= steps, (step, steps)
        assert set(copies) <= steps, (step, steps)
        assert len(slots) <= 4 and set(slots) <= set(state.SLOTS)


def test_copy_steps_are_the_multiples_of_the_cadence() -> None:
    assert [s for s in range(10) if state.is_copy_step(s, 3)] == [0, 3, 6, 9]
    assert all(state.is_copy_step(s, 1) for s in range(5))


def test_a_world_that_starts_afresh_though_state_was_kept_says_why_in_one_line() -> None:
    line = state.no_common_step({0: [12, 13], 1: [10, 11]}, 2)
    assert "rank 1 holds steps 10-11, rank 0 holds steps 12-13" in line
    assert "--state-copy-every" in line and "\n" not in line
    assert state.no_common_step({0: [3]}, 3) == (
        "rank 1 has no kept state (nor 1 more): the workers start afresh"
    )
