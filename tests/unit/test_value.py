"""``Value``, relaunch's one frozen value type: set once, equal by class and fields, hashable,
shown by its fields, and pickled or copied whole although it refuses every ``setattr``."""

from __future__ import annotations

import copy
import pickle

import pytest

from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange
from relaunch.core.rendezvous.node_order import Placing
from relaunch.core.rendezvous.rounds import Final, Settings
from relaunch.core.value import Value


class Point(Value):
    __slots__ = ("x", "y")
    x: int
    y: int

    def __init__(self, x: int, y: int = 0) -> None:
        self._set(x=x, y=y)


class Other(Value):
    __slots__ = ("x", "y")
    x: int
    y: int

    def __init__(self, x: int, y: int = 0) -> None:
        self._set(x=x, y=y)


def test_equal_by_class_and_fields_and_hashed_alike() -> None:
    assert Point(1, 2) == Point(1, y=2)
    assert Point(1, 2) != Point(1, 3)
    assert Point(1, 2) != Other(1, 2)
    assert Point(1, 2) != (1, 2)
    assert hash(Point(1, 2)) == hash(Point(1, 2))
    assert len({Point(1, 2), Point(1, 2), Other(1, 2)}) == 2
    assert repr(Point(1, 2)) == "Point(x=1, y=2)"


def test_a_value_is_frozen() -> None:
    point = Point(1)
    with pytest.raises(AttributeError, match="Point is frozen: x cannot be set"):
        point.x = 2
    with pytest.raises(AttributeError, match="Point is frozen: x cannot be deleted"):
        del point.x
    with pytest.raises(AttributeError):
        point.z = 3
    assert point == Point(1, 0)


def test_pickled_and_copied_whole() -> None:
    """The default way to unpickle a slotted object sets its slots with ``setattr``, which a
    value refuses: a value gives its own way, through the fields, without ``__init__``."""
    final = Final(2, 16, "node0", 29500, runs=((7, 2, 8),), placing=Placing((1, 0), (8, 0)))
    change = MembershipChange(ChangeKind.MEMBER_LOST, "node 1 stopped", member=1, detected_by=0)
    for value in (final, change, Settings(1, 2)):
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            again = pickle.loads(pickle.dumps(value, protocol))
            assert again == value and type(again) is type(value)
        assert copy.copy(value) == value
        assert copy.deepcopy(value) == value
    with pytest.raises(AttributeError):
        pickle.loads(pickle.dumps(final)).count = 3
