"""Network endpoints: ``HOST:PORT`` parsing, loopback checks and free ports.

Below the store and the rendezvous, so both can use it without importing each other.
"""

from __future__ import annotations


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    return host in ("localhost", "::1") or host.startswith("127.")


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host:port`` (or ``host``, or ``[v6]:port``) into its parts; ValueError when malformed."""
    text = endpoint.strip()
    if not text:
        raise ValueError("the endpoint is empty: expected HOST:PORT")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"endpoint {endpoint!r}: expected [IPV6] or [IPV6]:PORT")
        port_text = rest[1:]
        has_port = bool(rest)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        has_port = True
    else:
        host, port_text, has_port = text, "", False
    if not has_port:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(
            f"endpoint {endpoint!r} has port {port_text!r}: expected a number 0..65535"
        )
    return host, int(port_text)


def parse_endpoint_list(endpoints: str, default_port: int) -> list[tuple[str, int]]:
    """``host:port,host:port,...`` into its endpoints, each as ``parse_endpoint`` reads it;
    ValueError when one is malformed or one is named twice."""
    parsed: list[tuple[str, int]] = []
    for item in endpoints.split(","):
        endpoint = parse_endpoint(item, default_port)
        if endpoint in parsed:
            raise ValueError(f"the endpoint {item.strip()!r} is named twice in {endpoints!r}")
        parsed.append(endpoint)
    return parsed


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (asked with ``_socket`` alone:
    ``socket``'s 2 ms of imports are not on a launch's way to its workers)."""
    import _socket

    sock = _socket.socket(_socket.AF_INET6 if ":" in host else _socket.AF_INET)
    try:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    finally:
        sock.close()
    return port
