"""A ``start_processes`` of the user's (torch's, say), wrapped once where it enters the agent:
the ``PContext`` it returns gets what relaunch's has and it may lack (a failure callback and
grace, a group stop to hold, kept ranks, the failures so far, exit times), each a harmless
default, so the agent's code asks no object what it can do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from relaunch.procs.context import PContext, start_processes


def _nothing(*args: Any) -> None:
    return None


def _keep_nothing(local_rank: int) -> bool:
    return False


#: What relaunch's ``PContext`` has that a user's may lack, and what stands in for it.
DEFAULTS: dict[str, Callable[..., Any]] = {
    "add_failure_callback": _nothing,
    "set_failure_grace": _nothing,
    "hold_group_stop": _nothing,
    "kept": dict,
    "keep": _keep_nothing,
    "failures": dict,
    "exit_times": dict,
}


class UserPContext:
    """The ``PContext`` of a user's ``start_processes``, with ``DEFAULTS`` for what it lacks;
    ``can_keep``: it keeps ranks that park (has ``keep``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.can_keep = hasattr(inner, "keep")

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._inner, name)
        except AttributeError:
            if name in DEFAULTS:
                return DEFAULTS[name]
            raise


def adapt_start(start: Callable[..., PContext]) -> tuple[Callable[..., PContext], bool]:
    """``start``, wrapped when it is not relaunch's (its ``PContext`` a ``UserPContext``), and
    whether it is relaunch's."""
    if start is start_processes:
        return start, True

    def users(**arguments: Any) -> PContext:
        return cast(PContext, UserPContext(start(**arguments)))

    return users, False


def can_keep(pcontext: PContext) -> bool:
    """Whether ``pcontext`` keeps ranks that park for the next attempt."""
    return not isinstance(pcontext, UserPContext) or pcontext.can_keep
