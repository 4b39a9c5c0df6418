"""``python -m benchmarks NAME [--quick] [options]``, ``--list``, or ``NAME --help``.

Run from the repository root: the benchmarks import tests.support (and the chaos library,
tests.chaos) from there.
"""

from __future__ import annotations

import sys

from benchmarks import BENCHMARKS

USAGE = "usage: python -m benchmarks NAME [--quick] [--json PATH] [options] | --list"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print("\nbenchmarks (NAME --help for the options of one):")
        argv = ["--list"]
    if argv[0] == "--list":
        width = max(map(len, BENCHMARKS))
        for name, what in BENCHMARKS.items():
            print(f"  {name:<{width}}  {what}")
        return 0
    if argv[0] not in BENCHMARKS:
        print(f"{USAGE}\nunknown benchmark {argv[0]!r}; try --list", file=sys.stderr)
        return 2
    from benchmarks import harness

    return harness.main(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
