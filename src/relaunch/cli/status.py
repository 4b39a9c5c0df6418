"""``relaunch status``: a running job as a table, read from its rendezvous store.

Read-only: it connects to the store as a client, its kind's way (``rendezvous.kind_registry``),
and never writes a key (``rendezvous.reader``). Exit status: 0 once
the job was shown (``--watch``: on Ctrl-C, or once the job finished); 1 when it cannot be read:
the store cannot be reached, the token is missing or wrong, no job has that id, or the store
holds what no agent writes; 2 for bad input, in one line with no traceback.

``--rdzv-conf timeout=`` bounds each read of the job as a whole (``deadline.limit``), however
many requests it takes and however slowly the store answers; connecting is bounded apart. What
came from the store (names, states, reasons, its error texts) reaches the terminal only through
``core.output.status.printable``: no escape sequence from outside is ever written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING

from relaunch.cli.flag_row import checked, parse_rdzv_conf
from relaunch.cli.flags import EXIT_FAILED, _Parser, usage_error

if TYPE_CHECKING:
    from relaunch.rendezvous.groups_reader import GroupsReader, GroupsSnapshot
    from relaunch.rendezvous.reader import JobReader, Snapshot

PROG = "relaunch status"
#: Seconds between two reads with ``--watch`` and no value (agents post every 3 s).
WATCH_EVERY = 2.0
#: Seconds one read of the job may take, unless ``--rdzv-conf timeout=`` says otherwise.
TIMEOUT = 10.0


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flags; the rendezvous ones default to their ``PET_*`` variables, as the launcher's."""
    from relaunch.rendezvous.kind_registry import backend_names

    parser = _Parser(
        prog=PROG,
        description="Show a running job as a table, read from its rendezvous store (read-only): "
        "its nodes and ranks, each rank's state, step and rate, the stragglers, the restarts "
        "used and why, and when each node last posted. Exit status: 0 shown, 1 the job cannot "
        "be read (store unreachable, token missing or wrong, no such job), 2 bad input.",
    )
    parser.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        default=environ.get("PET_RDZV_BACKEND", "c10d"),
        choices=backend_names(),
        help="the job's rendezvous backend (default: c10d)",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=environ.get("PET_RDZV_ENDPOINT"),
        type=checked("parse_rdzv_endpoint"),
        metavar="HOST:PORT",
        help="the job's store (etcd: its members, comma-separated)",
    )
    parser.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        default=environ.get("PET_RDZV_ID"),
        metavar="ID",
        help="the job's id, as given to its agents",
    )
    parser.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default=environ.get("PET_RDZV_CONF", ""),
        type=parse_rdzv_conf,
        metavar="KEY=VALUE,...",
        help="token= (else $RELAUNCH_RDZV_TOKEN), timeout=, and etcd's protocol, cacert, cert, "
        "key, user, password: as given to the agents",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        const=WATCH_EVERY,
        type=checked("parse_bound"),
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {WATCH_EVERY:g}) until Ctrl-C or the job ends",
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON document (one a line with --watch)"
    )
    return parser


def open_reader(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[JobReader, str, float]:
    """A reader of the job over a client of its store, the store's address in words, and the
    seconds one read may take. ConfigError on bad input; StoreError when the store cannot be
    reached."""
    from relaunch.config import ConfigError, read_rdzv_conf
    from relaunch.rendezvous.kind_registry import EndpointError, kind_module

    if not args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint is required: the job's store, as given to its agents")
    if not args.rdzv_id:
        raise ConfigError("--rdzv-id is required: the job's id, as given to its agents")
    kind = kind_module(args.rdzv_backend)
    conf = read_rdzv_conf(args.rdzv_backend, args.rdzv_conf)
    timeout = conf.timeout if "timeout" in args.rdzv_conf else TIMEOUT
    try:
        reader, where = kind.open_reader(args.rdzv_endpoint, args.rdzv_id, conf, timeout, environ)
    except EndpointError as exc:
        raise ConfigError(f"--rdzv-endpoint: {exc}") from None
    return reader, where, timeout


def _job_or_groups(
    reader: JobReader, run_id: str, timeout: float
) -> tuple[JobReader | GroupsReader, Snapshot | GroupsSnapshot]:
    """``reader`` and what it read when the job is found; else the reader of its replica groups
    (``RUN_ID-group0``, ...) and what it read, when it has them; JobNotFound when neither is
    there. Each read within ``timeout`` seconds."""
    from relaunch.rendezvous.groups_reader import GroupsReader
    from relaunch.rendezvous.reader import JobNotFound

    try:
        return reader, read(reader, timeout)
    except JobNotFound:
        from relaunch.store.deadline import limit

        with limit(timeout):
            groups = GroupsReader.find(reader, run_id)
        if groups is None:
            raise
        return groups


def read(reader: JobReader | GroupsReader, timeout: float) -> Snapshot | GroupsSnapshot:
    """One read of the job, every request of it within ``timeout`` seconds in all."""
    from relaunch.store.deadline import limit

    with limit(timeout):
        return reader.read()


def status_main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Run ``relaunch status`` and return its exit status (see the module docstring)."""
    from relaunch.config import ConfigError
    from relaunch.rendezvous.reader import JobNotFound
    from relaunch.store.api import StoreAuthError, StoreError, StoreProtocolError

    env = os.environ if environ is None else environ
    where = "the store"
    try:
        args = build_parser(env).parse_args(argv)
        where = f"the store at {args.rdzv_endpoint}"
        job, where, timeout = open_reader(args, env)
        where = f"the store at {where}"
        reader, first = _job_or_groups(job, args.rdzv_id, timeout)
        if args.watch is None:
            show(first, args.json, sys.stdout)
            return 0
        return watch(reader, args.watch, args.json, sys.stdout, timeout)
    except ConfigError as exc:
        return usage_error(exc, PROG)
    except JobNotFound as exc:
        _error(f"{exc} at {where.removeprefix('the store at ')}: check --rdzv-id and the store")
    except StoreAuthError as exc:
        _error(f"{exc}: give the job's token (--rdzv-conf token=... or $RELAUNCH_RDZV_TOKEN)")
    except StoreProtocolError as exc:
        _error(f"cannot read the job from {where}: {exc} (is it the job's store?)")
    except StoreError as exc:
        from relaunch.rendezvous.kind_registry import kind_module

        hint = kind_module(args.rdzv_backend).UNREACHABLE_HINT
        _error(f"cannot read the job from {where}: {exc} ({hint})")
    except KeyboardInterrupt:
        return 0
    return EXIT_FAILED


def _error(message: str) -> None:
    """One line on stderr; what came from outside in ``message`` cannot act on the terminal."""
    from relaunch.core.output.status import printable

    print(f"{PROG}: error: {printable(message)}", file=sys.stderr)


def show(snapshot: Snapshot | GroupsSnapshot, as_json: bool, out: IO[str]) -> int:
    """Print ``snapshot`` once; the number of terminal rows it took. What the store held is
    printed through ``printable`` (JSON escapes it already: ``ensure_ascii``)."""
    from relaunch.core.output.status import printable

    text = json.dumps(snapshot.as_json()) if as_json else printable(snapshot.table(), True)
    out.write(text + "\n")
    out.flush()
    columns = shutil.get_terminal_size().columns
    return sum(max(1, -(-len(line) // columns)) for line in text.splitlines())


def watch(
    reader: JobReader | GroupsReader,
    every: float,
    as_json: bool,
    out: IO[str],
    timeout: float = TIMEOUT,
) -> int:
    """Show the job every ``every`` seconds: redrawn in place on a terminal, else one after the
    other (tables separated by a blank line, JSON one a line); 0 on Ctrl-C or once it finished.
    Each read takes at most ``timeout`` seconds."""
    redraw = out.isatty() and not as_json
    rows = 0
    first = True
    try:
        while True:
            snapshot = read(reader, timeout)
            if redraw and rows:
                out.write(f"\x1b[{rows}A\x1b[J")  # up to the last table's first row, clear below
            elif not first and not as_json:
                out.write("\n")
            rows = show(snapshot, as_json, out)
            first = False
            if snapshot.phase == "finished":
                return 0
            time.sleep(every)  # the refresh period: nothing to wait on but the clock
    except KeyboardInterrupt:
        return 0
