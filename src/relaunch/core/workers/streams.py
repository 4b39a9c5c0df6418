"""Which standard streams of a worker go to its log files, and how that is spelled."""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Std(enum.IntFlag):
    """A bitmask of standard streams: which of stdout and stderr a redirect or tee applies to."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse ``"3"`` into ``Std.ALL`` or ``"0:1,1:2"`` into ``{0: Std.OUT, 1: Std.ERR}``.

        Raises ValueError with the accepted forms when ``vm`` is neither.
        """
        text = vm.strip()
        if ":" not in text:
            return cls._parse_one(text, vm)
        per_rank: dict[int, Std] = {}
        for item in text.split(","):
            rank_text, sep, value_text = item.partition(":")
            if not sep or not rank_text.strip().isdigit():
                raise ValueError(_bad_std(vm))
            per_rank[int(rank_text)] = cls._parse_one(value_text.strip(), vm)
        return per_rank

    @classmethod
    def _parse_one(cls, text: str, whole: str) -> Std:
        if text.isdigit() and int(text) <= int(cls.ALL):
            return cls(int(text))
        raise ValueError(_bad_std(whole))


def _bad_std(value: str) -> str:
    return (
        f"invalid stream mask {value!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
        "or a per-rank map such as '0:3,1:1'"
    )


def per_rank(std: Std | Mapping[int, Std], nprocs: int) -> dict[int, Std]:
    """Expand ``std`` into one value per local rank; ranks a map does not name get ``Std.NONE``."""
    if isinstance(std, Mapping):
        return {rank: Std(std.get(rank, Std.NONE)) for rank in range(nprocs)}
    return dict.fromkeys(range(nprocs), Std(std))
