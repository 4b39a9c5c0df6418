"""torchrun's flags: the table (its rows in ``flags_job`` and ``flags_run``), and the parser
built from it with ``PET_*`` variables as defaults.

Nothing here loads the config code: each flag's value parser (``relaunch.cli.values``) is imported
when a value is first parsed, so ``relaunch --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from relaunch import __version__
from relaunch.cli.flags_job import JOB_FLAGS
from relaunch.cli.flags_run import RUN_FLAGS

EXIT_FAILED = 1
EXIT_USAGE = 2
#: The job failed for a reason that running it again cannot mend (restarts that made no
#: progress, the same failure again and again): a batch script should not requeue it. NVRx's
#: ft_launcher uses the same number.
EXIT_DO_NOT_REQUEUE = 93


def usage_error(exc: BaseException, prog: str) -> int:
    """Report a ``ConfigError`` in one line and return exit status 2; re-raise anything else."""
    from relaunch.config import ConfigError

    if not isinstance(exc, ConfigError):
        raise exc
    print(f"{prog}: error: {one_line(str(exc))} (see {prog} --help)", file=sys.stderr)
    return EXIT_USAGE


def one_line(text: str) -> str:
    """``text`` as one line of printable text: a value quoted in a message (a path, a flag's
    text) cannot break it in two, or reach the terminal as a control sequence."""
    return "".join(
        char if char.isprintable() else repr(char)[1:-1] for char in " ".join(text.splitlines())
    )


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are ``ConfigError`` (one line, exit status 2), which takes a flag
    only as spelled in full (a prefix of a later flag would silently change meaning) and names
    the closest flag to one it does not know."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._unknown(extras))
        return parsed

    def _unknown(self, extras: list[str]) -> str:
        flag = next((arg.split("=", 1)[0] for arg in extras if arg.startswith("-")), None)
        if flag is None:
            return "unrecognized arguments: " + " ".join(extras)
        import difflib

        known = [name for name in self._option_string_actions if name.startswith("--")]
        closest = difflib.get_close_matches(flag, known, n=1)
        if closest:
            return f"unknown flag {flag}: did you mean {closest[0]}?"
        return f"unknown flag {flag}"

    def error(self, message: str) -> None:  # type: ignore[override]
        from relaunch.config import ConfigError

        raise ConfigError(message)


def _spellings(name: str) -> tuple[str, ...]:
    """``--nproc-per-node`` and ``--nproc_per_node``."""
    underscored = "--" + name[2:].replace("-", "_")
    return (name,) if underscored == name else (name, underscored)


#: Every flag, in the order of ``--help``.
FLAGS = [*JOB_FLAGS, *RUN_FLAGS]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """torchrun's flags, each with its dash and underscore spelling and its PET_* variable."""
    env = os.environ if environ is None else environ
    parser = _Parser(
        prog="relaunch",
        description="Launch a distributed job: N workers per node, watched and restarted as one. "
        "Each flag can also be set by the environment variable PET_<FLAG> "
        "(e.g. PET_NPROC_PER_NODE=4).",
        epilog="Two subcommands: 'relaunch status' shows a running job's nodes and workers, read "
        "from its store; 'relaunch store' serves the built-in store on its own. Each takes --help.",
    )
    parser.add_argument("--version", action="version", version=f"relaunch {__version__}")
    groups = {
        name: parser.add_argument_group(name)
        for name in ("nodes", "rendezvous", "restarts", "state", "workers", "logs")
    }
    for flag in FLAGS:
        long_name = flag.names[-1]
        names = [*flag.names[:-1], *_spellings(long_name)]
        dest = flag.dest
        from_env = env.get(f"PET_{dest.upper()}")
        if from_env is None and flag.env is not None:
            from_env = env.get(flag.env)
        group = groups[flag.group]
        if flag.switch:
            switched_on = from_env is not None and from_env.lower() in ("1", "true", "yes")
            group.add_argument(
                *names, dest=dest, action="store_true", default=switched_on, help=flag.help_text()
            )
            continue
        # argparse converts a string default with ``type``, so PET_* values are checked too.
        default = flag.default if from_env is None else from_env
        group.add_argument(
            *names,
            dest=dest,
            default=default,
            type=flag.type or str,
            choices=flag.choices,
            metavar=flag.metavar,
            help=flag.help_text(),
        )
    parser.add_argument("training_script", help="the script, module or binary to run")
    rest = parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments passed to every worker"
    )
    rest.required, rest.default = False, []  # argparse requires REMAINDER, which may be empty
    return parser


def explicit_flags(argv: Sequence[str], environ: Mapping[str, str]) -> set[str]:
    """The flags (argparse's dests) given on the command line ``argv``, before the training
    script, or through their ``PET_*`` (or torchrun's) variable: what a scheduler's inference
    must not override."""
    spelled: dict[str, str] = {}
    takes_value: set[str] = set()
    for flag in FLAGS:
        dest = flag.dest
        for name in (*flag.names[:-1], *_spellings(flag.names[-1])):
            spelled[name] = dest
        if not flag.switch:
            takes_value.add(dest)
    given = {
        dest
        for flag in FLAGS
        for dest in (flag.dest,)
        if f"PET_{dest.upper()}" in environ or (flag.env is not None and flag.env in environ)
    }
    args = iter(argv)
    for arg in args:
        if not arg.startswith("-"):
            break  # the training script: what follows is its own
        found = spelled.get(arg.split("=", 1)[0])
        if found is None:
            continue
        given.add(found)
        if found in takes_value and "=" not in arg:
            next(args, None)
    return given
