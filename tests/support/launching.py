"""What ``relaunch ARGV`` would run with in a given environment, without running it: the flags
parsed (``PET_*`` from that environment), a scheduler's inference applied, the config checked.
Used by the tests of each scheduler's environment. The training script is ``train.py`` in the
current directory (``in_job_dir``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from relaunch import config
from relaunch.cli import command
from relaunch.cli.args import config_from_args
from relaunch.cli.flags import build_parser


def launch(argv: list[str], env: dict[str, str]) -> config.LaunchConfig:
    """The config relaunch runs with ``argv`` (after ``relaunch``) in ``env``."""
    args = build_parser(env).parse_args(argv)
    command._apply_scheduler(args, argv, env)
    launch_config, _, _ = config_from_args(args, env, 0, cpus=4, fresh_run_id="fresh")
    return launch_config


@contextmanager
def in_job_dir(path: str | os.PathLike[str]) -> Iterator[None]:
    """Run in ``path``, which gets an empty ``train.py``: the script the launches name."""
    previous = os.getcwd()
    with open(os.path.join(path, "train.py"), "w"):
        pass
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)
