"""One row of the flag table (``relaunch.cli.flags``), and the value parsers rows name.

Each value parser (``relaunch.cli.values``) is imported when a value is first parsed, so
``relaunch --help`` stays cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from relaunch.core.workers.streams import Std


def checked(name: str, *extra: Any) -> Callable[[str], Any]:
    """The value parser ``relaunch.cli.values.<name>`` for argparse, loaded on first use; its
    ConfigError becomes argparse's error, which names the flag."""

    def parse(text: str) -> Any:
        import relaunch.cli.values as values
        from relaunch.config import ConfigError

        try:
            return getattr(values, name)(text, *extra)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


parse_nnodes = checked("parse_nnodes")
parse_rdzv_conf = checked("parse_rdzv_conf")


class Flag:
    """One row of the table: the help group, the names, the default, the value parser, and
    ``field``, the ``LaunchConfig`` field its value sets (``group.field`` for a settings group's,
    ``core.run.settings``; None: ``relaunch.cli.args`` reads it itself)."""

    __slots__ = (
        "choices",
        "default",
        "env",
        "field",
        "group",
        "help",
        "metavar",
        "names",
        "switch",
        "type",
    )

    def __init__(
        self,
        group: str,
        names: tuple[str, ...],
        help: str,
        default: Any = None,
        type: Callable[[str], Any] | None = None,
        switch: bool = False,
        choices: tuple[str, ...] | None = None,
        metavar: str | None = None,
        env: str | None = None,
        field: str | None = None,
    ) -> None:
        self.group, self.names, self.help, self.default = group, names, help, default
        self.type, self.switch, self.choices, self.metavar = type, switch, choices, metavar
        #: A variable of torchrun's that sets the default when ``PET_<FLAG>`` is not set.
        self.env = env
        self.field = field

    @property
    def dest(self) -> str:
        """The name of its value in the parsed flags: ``--nproc-per-node``'s ``nproc_per_node``."""
        return self.names[-1].lstrip("-").replace("-", "_")

    def help_text(self) -> str:
        shown = self.default
        if isinstance(shown, Std):
            shown = int(shown)
        if shown is None or shown == "" or self.switch:
            return self.help
        return f"{self.help} (default: {shown})"
