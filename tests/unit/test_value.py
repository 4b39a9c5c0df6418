"""``Value``, relaunch's one frozen value type: set once, equal by class and fields, hashable,
shown by its fields, and pickled or copied whole although it refuses every ``setattr``."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from relaunch.agent.spec import RunResult, WorkerSpec, WorkerState
from relaunch.core.rendezvous.membership import ChangeKind, MembershipChange
from relaunch.core.rendezvous.node_order import Placing
from relaunch.core.rendezvous.rounds import Final, Settings
from relaunch.core.value import DataclassMethods, Value
from relaunch.procs.group_result import RunProcsResult
from relaunch.procs.process_failure import ProcessFailure
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.rendezvous.info import RendezvousStoreInfo


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


# -- DataclassMethods: torch's public dataclasses' __repr__ and __eq__, not compiled at import --


def _as_plain_dataclass(kind: type) -> type:
    """A twin of the public dataclass ``kind`` whose ``__repr__`` and ``__eq__`` dataclass
    compiles itself: the methods ``DataclassMethods`` must match."""
    twin = type(kind.__name__, (), {"__annotations__": {}, "__qualname__": kind.__qualname__})
    for field in dataclasses.fields(kind):
        twin.__annotations__[field.name] = field.type
        setattr(twin, field.name, dataclasses.field(repr=field.repr, compare=field.compare))
    return dataclasses.dataclass(init=False)(twin)


def _copied_into(value: object, kind: type) -> object:
    twin = object.__new__(kind)
    for field in dataclasses.fields(value):  # type: ignore[arg-type]
        setattr(twin, field.name, getattr(value, field.name))
    return twin


PUBLIC_DATACLASSES = [
    WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=None, entrypoint="train.py"),  # type: ignore[arg-type]
    RunResult(WorkerState.FAILED, {0: 1}, {}, [1]),
    RunProcsResult(return_values={0: None}, stdouts={0: "out"}),
    ProcessFailure(local_rank=1, pid=7, exitcode=-9, error_file="/nowhere/error.json"),
    RendezvousStoreInfo("127.0.0.1", 29500),
    RendezvousParameters("c10d", "127.0.0.1:29400", "job", 1, 2, timeout=30),
]


@pytest.mark.parametrize("value", PUBLIC_DATACLASSES, ids=lambda value: type(value).__name__)
def test_public_dataclasses_compare_and_show_as_dataclass_would(value: object) -> None:
    kind = type(value)
    assert isinstance(value, DataclassMethods) and dataclasses.is_dataclass(kind)
    twin_kind = _as_plain_dataclass(kind)
    twin = _copied_into(value, twin_kind)
    if "__repr__" not in vars(kind):  # RendezvousParameters shows its config redacted
        assert repr(value) == repr(twin)
    same, changed = copy.copy(value), copy.copy(value)
    first = next(f.name for f in dataclasses.fields(kind) if f.compare)  # type: ignore[arg-type]
    setattr(changed, first, object())
    assert (value == same, value == changed, value != same) == (True, False, False)
    assert (twin == copy.copy(twin), twin == _copied_into(changed, twin_kind)) == (True, False)
    assert value.__eq__(twin) is NotImplemented  # another class: as dataclass's
    with pytest.raises(TypeError):
        hash(value)  # a dataclass that compares and is not frozen is not hashable
