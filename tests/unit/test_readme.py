"""The README and docs/ read as one set: the README short (read in five minutes) with the two
set-up commands CI and the tests rely on, every relative link in README.md and docs/*.md leading
to a file (and heading) that exists, docs/README.md listing every page, and the user docs
speaking of the product, not of the issues that built it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import index

README = index.ROOT / "README.md"
DOCS = index.ROOT / "docs"
MAX_README_LINES = 200

#: The set-up commands, byte for byte: `.ci/run` runs the second and nothing else.
SET_UP = (
    "$ make demo     # installs relaunch and runs 4 workers of examples/hello.py, output tee'd\n"
    "$ make test     # installs what the tests need, then runs ruff, mypy and the whole test"
    " suite\n"
)

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks (a fence's lines become empty)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The targets of the Markdown links of a page, outside code."""
    found = []
    for line in prose(path.read_text()):
        found += LINK.findall(INLINE_CODE.sub("", line))
    return found


def broken(path: Path) -> list[str]:
    """The relative links of a page whose file or heading does not exist."""
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no such heading in {dest.relative_to(index.ROOT)})")
    return bad


def test_the_readme_is_short() -> None:
    count = len(README.read_text().splitlines())
    assert count <= MAX_README_LINES, (
        f"README.md has {count} lines, over {MAX_README_LINES}: move the detail to a page of docs/"
        " and leave one line with its link"
    )


def test_the_readme_gives_the_two_set_up_commands() -> None:
    assert SET_UP in README.read_text()
    run = (index.ROOT / ".ci" / "run").read_text().splitlines()
    assert [line for line in run if line and not line.startswith("#")][-1] == "make test"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(index.ROOT).as_posix())
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    bad = broken(page)
    assert not bad, f"{page.relative_to(index.ROOT)} links to nothing: " + ", ".join(bad)


def test_the_docs_index_lists_every_page() -> None:
    listed = {target.partition("#")[0] for target in links(DOCS / "README.md")}
    pages = [p.name for p in DOCS.iterdir() if p.is_file() and p.name != "README.md"]
    missing = sorted(name for name in pages if name not in listed)
    assert not missing, "docs/README.md does not list: " + ", ".join(missing)


def test_the_readme_links_the_docs_index_and_troubleshooting() -> None:
    targets = {target.partition("#")[0] for target in links(README)}
    assert {"docs/README.md", "docs/troubleshooting.md"} <= targets


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(index.ROOT).as_posix())
def test_the_docs_speak_of_the_product_not_of_issues(page: Path) -> None:
    said = [
        f"{n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"\bissues? \d+", line, re.IGNORECASE)
    ]
    assert not said, f"{page.relative_to(index.ROOT)} names issues:\n" + "\n".join(said)


def test_anchors_and_links_are_read_as_github_does(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text(
        "# Device placement: GPU subsets, a device per rank\n## `relaunch status`: at a glance\n"
        "## Part\n## Part\n```python\n# not a heading [x](gone.md)\n```\n"
        "See [b](b.md#part-1), `[c](code.md)` and [web](https://example.com/x).\n"
    )
    assert anchors(page) == {
        "device-placement-gpu-subsets-a-device-per-rank",
        "relaunch-status-at-a-glance",
        "part",
        "part-1",
    }
    assert links(page) == ["b.md#part-1", "https://example.com/x"]
    assert broken(page) == ["b.md#part-1 (no such file)"]
