"""The ``relaunch`` command: torchrun's flags in, an exit status out.

``flags`` holds the table of flags and the parser, ``values`` the parsers of their values,
``command`` the command itself (``main``), and ``store`` the ``relaunch store`` subcommand (loaded
only for it). The config they build, and its checks, live in ``relaunch.config``.
"""

from __future__ import annotations

from relaunch.cli.command import (
    config_from_args,
    console_main,
    count_gpus,
    main,
    resolve_nproc,
)
from relaunch.cli.flags import (
    DEFAULT_SIGNALS,
    EXIT_FAILED,
    EXIT_USAGE,
    FLAGS,
    build_parser,
    parse_nnodes,
    parse_rdzv_conf,
)

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
