"""``Value``: the one way to make a frozen value type in relaunch's own code.

A ``Value`` is a plain class whose fields are its ``__slots__``, set once by a hand-written
``__init__``, compared by class and fields, hashable, shown as ``Name(field=value, ...)`` and
made a dict (``as_dict``), its fields in the order its class declares them. Not a dataclass nor
a named tuple: the launcher makes these classes at every start, and Python 3.11 compiles a
frozen dataclass's methods with ``exec`` (about 0.45 ms a class, a named tuple about 0.15 ms),
a plain class a few microseconds. Public types keep torch's dataclasses.

A value class subclasses ``Value`` directly, names its fields in ``__slots__`` (a field's type
as an annotation without a default), checks its arguments in ``__init__`` and gives them to
``_set``::

    class Mark(Value):
        __slots__ = ("signs", "step")
        step: int | None
        signs: int

        def __init__(self, step: int | None = None, signs: int = 0) -> None:
            self._set(step=step, signs=signs)
"""

from __future__ import annotations

from typing import Any, TypeVar

_V = TypeVar("_V", bound="Value")


class Value:
    """A frozen value: its fields are its class's ``__slots__``, given to ``__init__`` and never
    changed; equal to a value of the same class with equal fields."""

    __slots__: tuple[str, ...] = ()

    def _set(self, **fields: Any) -> None:
        """Give the fields their values (in ``__init__`` only)."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: {name} cannot be set")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: {name} cannot be deleted")

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Value)
            and type(other) is type(self)
            and self._fields() == other._fields()
        )

    def __hash__(self) -> int:
        return hash((type(self), self._fields()))

    @classmethod
    def _declared(cls) -> tuple[str, ...]:
        """Its fields in the order its class declares them (``__slots__`` is kept sorted)."""
        annotations = vars(cls).get("__annotations__", {})  # its own, not Value's
        return tuple(name for name in annotations if name in cls.__slots__)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._declared())
        return f"{type(self).__name__}({shown})"

    def as_dict(self) -> dict[str, Any]:
        """Its fields by name, in the order its class declares them, the values within (alone,
        in lists or in dicts) as dicts too: the shape ``dataclasses.asdict`` gives, for JSON."""
        return {name: _plain(getattr(self, name)) for name in self._declared()}

    def replace(self: _V, **changes: Any) -> _V:
        """A copy with ``changes`` to its fields, made by ``__init__``, whose checks run again
        (as ``dataclasses.replace`` makes one)."""
        return type(self)(**{**dict(zip(self.__slots__, self._fields(), strict=True)), **changes})

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied by its fields, rebuilt without ``__init__`` (as a dataclass is):
        the default way would set the slots through ``__setattr__``, which refuses."""
        return (_rebuilt, (type(self), self._fields()))


class DataclassMethods:
    """A public dataclass's ``__repr__`` and ``__eq__`` as ``dataclass`` writes them, for one
    made with ``@dataclass(repr=False, eq=False)``: the same text and comparison, without
    compiling two methods for each class as the launcher starts (about 0.15 ms a class). Not
    hashable, as a dataclass that compares is not."""

    __slots__ = ()

    def __repr__(self) -> str:
        from dataclasses import fields  # loaded: a dataclass subclasses this

        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr]  # type: ignore[arg-type]
        return f"{type(self).__qualname__}({', '.join(shown)})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        from dataclasses import fields

        compared = [f.name for f in fields(self) if f.compare]  # type: ignore[arg-type]
        mine = tuple(getattr(self, name) for name in compared)
        return mine == tuple(getattr(other, name) for name in compared)

    __hash__ = None  # type: ignore[assignment]


def _plain(field: Any) -> Any:
    """``field`` with every value in it as its ``as_dict`` (lists and dicts copied)."""
    if isinstance(field, Value):
        return field.as_dict()
    if isinstance(field, list):
        return [_plain(item) for item in field]
    if isinstance(field, dict):
        return {key: _plain(item) for key, item in field.items()}
    return field


def _rebuilt(kind: type[Value], fields: tuple[Any, ...]) -> Value:
    """A ``kind`` with ``fields`` (``Value.__reduce__``)."""
    value = object.__new__(kind)
    for name, field in zip(kind.__slots__, fields, strict=True):
        object.__setattr__(value, name, field)
    return value
