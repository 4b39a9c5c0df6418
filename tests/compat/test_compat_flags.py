"""torchrun 2.13's flags on the ``relaunch`` command: every option string of torch's own
parser is one of relaunch's, and the docs give their number as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.cli.flags import build_parser

pytestmark = pytest.mark.xdist_group("torch")

DOCS = Path(__file__).parents[2] / "docs" / "moving-from-torchrun.md"


def torchrun_options() -> dict[str, list[str]]:
    """Each of torchrun's flags (by its destination) -> its option strings, help apart."""
    from torch.distributed.run import get_args_parser

    return {
        action.dest: action.option_strings
        for action in get_args_parser()._actions
        if action.option_strings and action.dest != "help"
    }


def test_relaunch_takes_every_torchrun_flag() -> None:
    ours = {option for action in build_parser({})._actions for option in action.option_strings}
    missing = sorted(o for options in torchrun_options().values() for o in options if o not in ours)
    assert not missing, "relaunch does not take torchrun's " + ", ".join(missing)


def test_the_docs_count_torchruns_flags() -> None:
    assert f"All {len(torchrun_options())} flags of torchrun 2.13" in DOCS.read_text()
