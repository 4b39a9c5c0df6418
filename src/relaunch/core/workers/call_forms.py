"""Functions that take two forms of call: torch 2.13's and the seeds' (torch < 2.2).

``start_processes``, ``LocalElasticAgent`` and ``TailLog`` changed their positional parameters
between the two: torch 2.13 takes a ``LogsSpecs`` where the seeds took a log directory (or a
start method, or an interval). Each such function tells the form from the value at the place
where they part, then names its arguments by that form (``bind``); a keyword
of the other form is an error that says how to write the call in one form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relaunch.core.value import Value


class CallForm(Value):
    """One form of call: its parameters in positional order (from where the forms part), the
    keywords it takes besides, and what to do when the other form's keywords are mixed in."""

    __slots__ = ("hint", "keywords", "label", "positional")

    label: str
    positional: tuple[str, ...]
    keywords: frozenset[str]
    hint: str

    def __init__(
        self,
        label: str,
        positional: tuple[str, ...],
        keywords: frozenset[str] = frozenset(),
        hint: str = "",
    ) -> None:
        self._set(label=label, positional=positional, keywords=keywords, hint=hint)

    def takes(self, name: str) -> bool:
        return name in self.positional or name in self.keywords


def bind(
    function: str,
    form: CallForm,
    other: CallForm,
    positional: tuple[Any, ...],
    keywords: Mapping[str, Any],
) -> dict[str, Any]:
    """The arguments given, by name, as ``form`` reads ``positional`` then ``keywords``
    (defaults are the caller's). TypeError, in one line, as Python words its own: too many
    positional arguments, one given twice, an unknown keyword, or one of ``other``'s form."""
    if len(positional) > len(form.positional):
        raise TypeError(
            f"{function}() takes at most {len(form.positional)} arguments from "
            f"{form.positional[0]} on in {form.label} form "
            f"({', '.join(form.positional)}), {len(positional)} given"
        )
    bound = dict(zip(form.positional, positional, strict=False))
    for name, value in keywords.items():
        if name in bound:
            raise TypeError(f"{function}() got multiple values for argument {name!r}")
        if not form.takes(name):
            if other.takes(name):
                raise TypeError(
                    f"{function}() got {name}= of {other.label} form in a call of "
                    f"{form.label} form (with {form.positional[0]}): {form.hint}"
                )
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        bound[name] = value
    return bound


def choose(
    function: str,
    torch: CallForm,
    seeds: CallForm,
    positional: tuple[Any, ...],
    keywords: Mapping[str, Any],
    is_torch: Callable[[object], bool],
    is_seeds: Callable[[object], bool],
    place: str,
) -> tuple[CallForm, dict[str, Any]]:
    """The form of a call and its arguments by name (``bind``): torch's when the first value
    where the forms part is one of torch's (``is_torch``), or, with no such value, when
    torch's first parameter is given by keyword; else the seeds'. TypeError, in one line, when
    that value is of neither form; ``place`` says where that value goes ("its 5th argument")."""
    first = torch.positional[0]
    if positional:
        value, where = positional[0], place
    elif first in keywords:
        value, where = keywords[first], f"{first}="
    else:
        return seeds, bind(function, seeds, torch, positional, keywords)
    if is_torch(value):
        return torch, bind(function, torch, seeds, positional, keywords)
    if positional and is_seeds(value):
        return seeds, bind(function, seeds, torch, positional, keywords)
    raise TypeError(
        f"{function}() takes a {first} ({torch.label} form) or a {seeds.positional[0]} "
        f"({seeds.label} form) as {where}, got {type(value).__name__} {value!r}"
    )
