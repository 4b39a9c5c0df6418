from __future__ import annotations

import pytest

from relaunch.core.workers.macros import substitute_local_rank
from relaunch.core.workers.streams import Std, per_rank


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        (" 3 ", Std.ALL),
        ("0:1,1:2", {0: Std.OUT, 1: Std.ERR}),
        ("0:3", {0: Std.ALL}),
        ("2:0, 5:3", {2: Std.NONE, 5: Std.ALL}),
    ],
)
def test_from_str_accepts_masks_and_rank_maps(text: str, expected: object) -> None:
    assert Std.from_str(text) == expected


@pytest.mark.parametrize("text", ["4", "9", "-1", "all", "", "0:", ":1", "a:1", "0:1,1", "0:7"])
def test_from_str_rejects_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected 0 \(none\), 1 \(stdout\)"):
        Std.from_str(text)


def test_all_is_out_and_err() -> None:
    assert Std.ALL == Std.OUT | Std.ERR
    assert Std.ALL & Std.ERR


def test_per_rank_expands_a_mask_and_fills_a_map_with_none() -> None:
    assert per_rank(Std.OUT, 3) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}
    assert per_rank({1: Std.ERR}, 3) == {0: Std.NONE, 1: Std.ERR, 2: Std.NONE}


def test_local_rank_macro_is_substituted_in_strings_only() -> None:
    args = ("--out=/tmp/${local_rank}/x", 7, "${local_rank}${local_rank}", ["${local_rank}"])
    assert substitute_local_rank(args, 3) == ("--out=/tmp/3/x", 7, "33", ["${local_rank}"])
