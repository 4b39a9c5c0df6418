"""``relaunch store``: the built-in rendezvous store, served on its own in the foreground."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from relaunch.cli.flag_row import checked
from relaunch.cli.flags import EXIT_USAGE, _Parser, usage_error
from relaunch.core.rendezvous.rdzv_conf import C10D_DEFAULT_PORT


def store_main(argv: Sequence[str]) -> int:
    """Serve the store until SIGTERM or SIGINT (blocked by the caller, taken by ``sigwait``)."""
    from relaunch.core.rendezvous.rdzv_conf import TOKEN_ENV

    parser = _Parser(
        prog="relaunch store",
        description="Serve the built-in rendezvous store until SIGTERM or SIGINT.",
    )
    parser.add_argument(
        "--host",
        type=checked("parse_loopback"),
        default="127.0.0.1",
        help="loopback address to listen on (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=checked("parse_count", 0),
        default=C10D_DEFAULT_PORT,
        help=f"port to listen on, 0 for any free one (default: {C10D_DEFAULT_PORT})",
    )
    parser.add_argument(
        "--token", default=None, help=f"shared secret clients must prove (default: ${TOKEN_ENV})"
    )
    try:
        args = parser.parse_args(argv)
    except Exception as exc:  # the parser's ConfigError
        return usage_error(exc, "relaunch store")
    from relaunch.store.server import TcpStoreServer

    try:
        server = TcpStoreServer(args.host, args.port, args.token or os.environ.get(TOKEN_ENV))
    except OSError as exc:
        print(
            f"relaunch store: error: cannot listen on {args.host}:{args.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(f"relaunch store: serving on {server.endpoint}", flush=True)
    try:
        server.start()
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    finally:
        server.stop()
    return 0
