"""The ``relaunch`` command: torchrun's flags in, an exit status out.

``flags`` holds the table of flags and the parser, ``values`` the parsers of their values,
``args`` the parsed flags into a checked ``relaunch.config.LaunchConfig``, ``command`` the
command itself (``main``) with the table of the exceptions it ends on and their exit statuses,
and ``store`` the ``relaunch store`` subcommand (loaded only for it). ``args``' names load on
first use, so that ``relaunch --help`` loads no config code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaunch.cli.command import console_main, main
from relaunch.cli.flag_row import parse_nnodes, parse_rdzv_conf
from relaunch.cli.flags import EXIT_FAILED, EXIT_USAGE, FLAGS, build_parser
from relaunch.cli.flags_job import DEFAULT_SIGNALS
from relaunch.runtime import lazy_attributes

if TYPE_CHECKING:
    from relaunch.cli.args import config_from_args, resolve_nproc
    from relaunch.placement import count_gpus

__all__ = [
    "DEFAULT_SIGNALS",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "FLAGS",
    "build_parser",
    "config_from_args",
    "console_main",
    "count_gpus",
    "main",
    "parse_nnodes",
    "parse_rdzv_conf",
    "resolve_nproc",
]

#: The names loaded on first use, and their modules.
_LAZY = {
    "config_from_args": "relaunch.cli.args",
    "resolve_nproc": "relaunch.cli.args",
    "count_gpus": "relaunch.placement",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
