"""torch's ``torch.distributed.elastic.rendezvous.utils``, at relaunch's path:
``parse_rendezvous_endpoint`` with torch's meaning, over ``relaunch.endpoints.parse_endpoint``."""

from __future__ import annotations

import re

from relaunch.endpoints import parse_endpoint

__all__ = ["parse_rendezvous_endpoint"]

#: A host name (dot-separated labels), an IPv4 address or an IPv6 address, as torch accepts.
_HOST = re.compile(r"[\w.:-]+")


def parse_rendezvous_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """``(host, port)`` of ``HOST[:PORT]`` (``[V6]:PORT`` for an IPv6 address), ``default_port``
    when no port is given, ``("localhost", default_port)`` for None or blank; ValueError for a
    port outside 0..65535 or a host that is no name or address."""
    if endpoint is None or not endpoint.strip():
        return "localhost", default_port
    host, port = parse_endpoint(endpoint, default_port)
    if not _HOST.fullmatch(host):
        raise ValueError(
            f"rendezvous endpoint {endpoint.strip()!r}: the host {host!r} must be a host name, "
            "an IPv4 address, or an IPv6 address"
        )
    return host, port
