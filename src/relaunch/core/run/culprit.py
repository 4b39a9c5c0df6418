"""A hang's culprit: the rank the others wait for, from where every rank of the job stopped.

On a hang relaunch takes every rank's stack (Python's faulthandler dump). Most ranks of a hung
job wait in a collective for one or a few that never came; those stand apart in their stacks.
Each node reduces its ranks' dumps to a ``Place`` (the collective a rank waits in, if any, and
its innermost frame of the user's code), publishes them (``encode``; ``decode`` checks what
another host sent) and every node gives the same ``verdict`` over the job's places. Pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence

from relaunch.core.value import Value

#: The most characters of a place's names (a function, a file) kept and accepted.
MAX_NAME = 200
#: The most ranks one node's places may hold, and the largest rank accepted.
MAX_RANKS = 4096
MAX_RANK = 1 << 20
#: The largest line number accepted.
MAX_LINE = 10**7
#: The most bytes of one node's encoded places accepted (about 100 bytes a rank).
MAX_BYTES = 128 * MAX_RANKS
#: A thread's heading in a faulthandler dump, and one of its frames.
_THREAD = r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):$|^Stack \("
_FRAME = r'^\s*File "([^"\n]*)", line (\d+) in (\S+)'
#: Frames that are not the user's: the standard library, installed packages, frozen modules,
#: relaunch's own (the function worker, ``--run-path``).
_LIBRARY = r"^<|/lib/python\d[^/]*/|/site-packages/|/dist-packages/|/relaunch/[\w/]*\.py$"
#: Files whose public functions are collectives (torch's), where a rank waits for the others.
_COLLECTIVES = r"/torch/distributed/(?:distributed_c10d|_functional_collectives)\.py$"
#: The outermost frame of a thread that is not the main one.
_THREAD_START = ("threading.py", "_bootstrap")


class Frame(Value):
    """A place in the code: a function, the file's name (without its directory) and the line."""

    __slots__ = ("file", "function", "line")

    function: str
    file: str
    line: int

    def __init__(self, function: str, file: str, line: int) -> None:
        self._set(function=function, file=file, line=line)

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})"


class Place(Value):
    """Where a rank stopped: the collective it waits in ("" if none) and its innermost frame of
    the user's code (else its innermost frame; None when its stack had none)."""

    __slots__ = ("collective", "frame")

    collective: str
    frame: Frame | None

    def __init__(self, collective: str = "", frame: Frame | None = None) -> None:
        self._set(collective=collective, frame=frame)

    def key(self) -> tuple[str, str, str]:
        """What ranks in the same place share: the collective, else the function and its file
        (not the line: a rank that loops moves between lines)."""
        if self.collective:
            return ("collective", self.collective, "")
        if self.frame is None:
            return ("frame", "", "")
        return ("frame", self.frame.function, self.frame.file)

    def __str__(self) -> str:
        where = "" if self.frame is None else str(self.frame)
        if self.collective:
            return f"{self.collective}, from {where}" if where else self.collective
        return where or "a stack without a frame"


class Verdict(Value):
    """Who the others waited for: ``culprits`` (empty when the stacks do not say) and ``line``,
    the sentence a report prints; ``kind``: ``culprit``, ``same`` (every rank in one place),
    ``split`` (no place holds more ranks than every other) or ``none`` (no stack)."""

    __slots__ = ("culprits", "kind", "line")

    culprits: tuple[int, ...]
    kind: str
    line: str

    def __init__(self, culprits: Iterable[int], kind: str, line: str) -> None:
        self._set(culprits=tuple(sorted(culprits)), kind=kind, line=line)


def place_of(dump: str) -> Place | None:
    """Where the rank whose faulthandler ``dump`` this is stopped; None: no Python stack (a
    binary, or a rank that died before it could write one)."""
    threads: list[list[Frame]] = []
    for text in dump.splitlines():
        if re.match(_THREAD, text):
            threads.append([])
            continue
        found = re.match(_FRAME, text)
        if found is not None and threads:
            path, line, function = found.groups()
            threads[-1].append(Frame(function, path, int(line)))
    threads = [frames for frames in threads if frames]
    if not threads:
        return None
    waiting = [(_collective(frames), frames) for frames in threads]
    # The thread that waits in a collective, else the main one (not started by ``threading``),
    # else the first written (the one the signal interrupted).
    chosen = next((pair for pair in waiting if pair[0]), None)
    if chosen is None:
        chosen = next((pair for pair in waiting if not _started_thread(pair[1])), waiting[0])
    collective, frames = chosen
    user = next((frame for frame in frames if not re.search(_LIBRARY, frame.file)), frames[0])
    name = user.file.rsplit("/", 1)[-1]
    return Place(collective, Frame(user.function[:MAX_NAME], name[-MAX_NAME:], user.line))


def _collective(frames: Sequence[Frame]) -> str:
    """The collective a thread waits in (its innermost frame in torch's collectives), or ""."""
    for frame in frames:
        if re.search(_COLLECTIVES, frame.file) and not frame.function.startswith(("_", "wrap")):
            return frame.function[:MAX_NAME]
    return ""


def _started_thread(frames: Sequence[Frame]) -> bool:
    outer = frames[-1]
    return outer.file.endswith(_THREAD_START[0]) and outer.function == _THREAD_START[1]


def verdict(
    places: Mapping[int, Place | None], missing: Sequence[int] = (), waited: float = 0.0
) -> Verdict:
    """Which ranks the others wait for, from every rank's place (None: it gave no stack).
    ``missing``: the nodes (group ranks) whose places did not come within ``waited`` seconds.

    One collective holds ranks: those elsewhere did not reach it. Otherwise (no collective, or
    several) the place that holds more ranks than any other is where they wait and the rest
    stand apart; when two places hold as many, or every rank is in one place, it says so."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for rank in sorted(places):
        place = places[rank]
        if place is not None:
            groups.setdefault(place.key(), []).append(rank)
    notes = _notes(places, missing, waited)
    if not groups:
        line = (
            "no rank gave a Python stack (binary workers, or ranks that died before they could): "
            "relaunch cannot tell which rank the others wait for"
        )
        return Verdict((), "none", line + notes)
    first = {key: places[ranks[0]] for key, ranks in groups.items()}
    if len(groups) == 1:
        ((key, ranks),) = groups.items()
        if len(ranks) == 1:
            line = f"{_ranks(ranks)} alone gave a stack ({first[key]}): nothing to compare it with"
            return Verdict((), "same", line + notes)
        how = "wait in the same collective" if key[0] == "collective" else "are in the same place"
        line = f"{_ranks(ranks)} all {how}, {first[key]}: none stands apart from the others"
        return Verdict((), "same", line + notes)
    collectives = [key for key in groups if key[0] == "collective"]
    if len(collectives) == 1:
        wait = collectives[0]
    else:
        by_size = sorted(groups, key=lambda key: len(groups[key]), reverse=True)
        if len(groups[by_size[0]]) == len(groups[by_size[1]]):
            shown = "; ".join(f"{_ranks(groups[key])}: {first[key]}" for key in by_size[:4]) + (
                "; ..." if len(by_size) > 4 else ""
            )
            line = (
                f"the ranks split evenly ({shown}): relaunch cannot tell which the others wait for"
            )
            return Verdict((), "split", line + notes)
        wait = by_size[0]
    culprits = [rank for key, ranks in groups.items() if key != wait for rank in ranks]
    return Verdict(culprits, "culprit", _named(culprits, groups[wait], places) + notes)


def _named(culprits: list[int], waiting: list[int], places: Mapping[int, Place | None]) -> str:
    """``rank 2 did not reach the collective that ranks 0, 1, 3 wait in (all_reduce): it is in
    load_next_batch (train.py:15)``, or its form without a collective."""
    where = places[waiting[0]]
    assert where is not None
    subject = _ranks(culprits)
    they = _ranks(waiting)
    if where.collective:
        head = f"{subject} did not reach the collective that {they} wait in ({where.collective})"
    else:
        head = (
            f"{subject} {'is' if len(culprits) == 1 else 'are'} not where {they} wait, in {where}"
        )
    spots: dict[Place, list[int]] = {}
    for rank in culprits:
        place = places[rank]
        assert place is not None
        spots.setdefault(place, []).append(rank)
    if len(spots) == 1:
        ((spot, _),) = spots.items()
        return f"{head}: {'it' if len(culprits) == 1 else 'they'} {_at(spot, len(culprits))}"
    shown = [f"{_ranks(ranks)} {_at(spot, len(ranks))}" for spot, ranks in list(spots.items())[:4]]
    return f"{head}: {', '.join(shown)}{', ...' if len(spots) > 4 else ''}"


def _at(place: Place, count: int) -> str:
    """``is in f (x.py:3)`` or ``waits in barrier, from ...``, for ``count`` ranks."""
    if place.collective:
        return f"{'waits' if count == 1 else 'wait'} in {place}"
    return f"{'is' if count == 1 else 'are'} in {place}"


def _notes(places: Mapping[int, Place | None], missing: Sequence[int], waited: float) -> str:
    """What the verdict was given without: ranks with no stack, nodes whose places never came."""
    notes = ""
    bare = [rank for rank in sorted(places) if places[rank] is None]
    if bare and len(bare) < len(places):
        notes += f"; {_ranks(bare)} gave no Python stack"
    if missing:
        nodes = ", ".join(map(str, sorted(missing)))
        node = "node" if len(missing) == 1 else "nodes"
        notes += f"; {node} {nodes} sent no stacks within {waited:g}s (not counted)"
    return notes


def _ranks(ranks: Iterable[int]) -> str:
    """``rank 2``, ``ranks 0, 1, 3``, ``ranks 0-7, 9``: runs of three or more as ranges."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = 0
    for index in range(1, len(ordered) + 1):
        if index == len(ordered) or ordered[index] != ordered[index - 1] + 1:
            run = ordered[start:index]
            if len(run) >= 3:
                parts.append(f"{run[0]}-{run[-1]}")
            else:
                parts.extend(map(str, run))
            start = index
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(parts)


def encode(places: Mapping[int, Place | None]) -> bytes:
    """One node's places, for the other nodes (``decode`` reads them)."""
    ranks: dict[str, object] = {}
    for rank, place in sorted(places.items())[:MAX_RANKS]:
        if place is None or place.frame is None:
            ranks[str(rank)] = None if place is None else [place.collective, "", "", 0]
        else:
            frame = place.frame
            ranks[str(rank)] = [place.collective, frame.function, frame.file, frame.line]
    return json.dumps({"ranks": ranks}, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[int, Place | None]:
    """The places another node sent; ValueError, saying what is wrong, when they are not
    ``encode``'s within its bounds (it came from another host)."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{len(data)} bytes, more than {MAX_BYTES}")
    try:
        shape = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ValueError(f"not JSON: {exc}") from None
    ranks = shape.get("ranks") if isinstance(shape, dict) else None
    if not isinstance(ranks, dict) or len(ranks) > MAX_RANKS:
        raise ValueError(f"not a map of at most {MAX_RANKS} ranks")
    places: dict[int, Place | None] = {}
    for rank, fields in ranks.items():
        if not (rank.isdigit() and int(rank) < MAX_RANK):
            raise ValueError(f"not a rank: {rank[:20]!r}")
        places[int(rank)] = None if fields is None else _place(fields)
    return places


def _place(fields: object) -> Place:
    if not (isinstance(fields, list) and len(fields) == 4):
        raise ValueError("a place is [collective, function, file, line]")
    collective, function, file, line = fields
    for name in (collective, function, file):
        if not isinstance(name, str) or len(name) > MAX_NAME or not name.isprintable():
            raise ValueError(f"a name of at most {MAX_NAME} printable characters, not {name!r:.40}")
    if isinstance(line, bool) or not isinstance(line, int) or not 0 <= line < MAX_LINE:
        raise ValueError(f"not a line number: {line!r:.20}")
    return Place(collective, Frame(function, file, line) if function else None)
