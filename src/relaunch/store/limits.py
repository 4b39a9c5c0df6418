"""What the built-in store says of the open-file limit: raised for the clients expected, and
one line when it is too low for them (``store.server``)."""

from __future__ import annotations

import logging
import resource

from relaunch.runtime import open_descriptors, raise_open_file_limit

log = logging.getLogger("relaunch.store.server")

#: Descriptors a hosting process needs besides the store's connections (its logs, its workers'
#: pipes, the clients of its own store): part of what the open-file limit must allow.
_FD_MARGIN = 256


def check_open_file_limit(connections: int, expected: int) -> None:
    """Raise the soft open-file limit for ``connections`` (``expected`` of them clients) if it
    is too low; one warning (how many fit, how many may come, what to do) if the hard limit is
    too low."""
    in_use = open_descriptors()
    needed = in_use + connections + _FD_MARGIN
    soft, hard = raise_open_file_limit(needed)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    log.warning(
            "store: the open-file limit (%d, hard limit %s) leaves room for about %d "
            "connections, but up to %d may come: raise it to at least %d (`ulimit -n %d` in "
            "the shell that starts relaunch, LimitNOFILE=%d in a systemd unit, "
            "--ulimit nofile=%d in a container)",
            soft, hard_text, max(soft - in_use, 0), expected, needed, needed, needed, needed,
        )  # fmt: skip


def say_tokenless_full(count: int) -> None:
    """A store without a token holds as many connections as it may (``count``)."""
    log.warning(
        "store: %d connections, the most a store without a token holds under an "
        "open-file limit of %d: new clients wait until some close; set a token "
        "(--rdzv-conf token=..., RELAUNCH_RDZV_TOKEN) so that only members count",
        count,
        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    )


def say_out_of_descriptors(exc: OSError, count: int) -> None:
    """Out of descriptors with clients waiting, ``count`` open."""
    log.warning(
        "store: cannot accept more connections (%s) with %d open and an open-file "
        "limit of %d: new clients wait until some close; raise the limit (`ulimit -n`, "
        "systemd LimitNOFILE)",
        exc.strerror or exc,
        count,
        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    )
