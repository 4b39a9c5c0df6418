"""relaunch.rendezvous beside torch.distributed.elastic.rendezvous: the endpoint parser, the
exception classes and where they are raised, and the handler registry a user's backend plugs
into."""

from __future__ import annotations

import pytest

from relaunch.endpoints import parse_endpoint
from relaunch.rendezvous.utils import parse_rendezvous_endpoint

pytestmark = pytest.mark.xdist_group("torch")

torch_utils = pytest.importorskip("torch.distributed.elastic.rendezvous.utils")

ENDPOINTS = [
    None,
    "",
    "  ",
    "node",
    "node:1",
    " node:2 ",
    "node:65535",
    "10.0.0.1:80",
    "[::1]",
    "[fe80::1]:29400",
    "node.example.com:29400",
]
BAD = ["node:65536", "node:x", "node:", "node:-1", "a b:3", "node/x", "[::1]x", "[::1]:"]


def test_parse_rendezvous_endpoint_reads_what_torchs_reads() -> None:
    for endpoint in ENDPOINTS:
        assert parse_rendezvous_endpoint(endpoint, 29400) == (
            torch_utils.parse_rendezvous_endpoint(endpoint, 29400)
        ), endpoint


def test_parse_rendezvous_endpoint_refuses_what_torchs_refuses() -> None:
    for endpoint in BAD:
        with pytest.raises(ValueError):
            torch_utils.parse_rendezvous_endpoint(endpoint, 29400)
        with pytest.raises(ValueError, match="endpoint"):
            parse_rendezvous_endpoint(endpoint, 29400)


def test_a_bare_ipv6_address_is_a_host_not_a_port() -> None:
    # torch reads "::1" as host ":" and port 1; relaunch as the address, on the default port.
    assert parse_rendezvous_endpoint("::1", 29400) == ("::1", 29400)


def test_an_empty_port_is_refused_everywhere() -> None:
    for endpoint in ("node:", "[::1]:", "[::1]x"):
        with pytest.raises(ValueError, match="expected"):
            parse_endpoint(endpoint, 29400)
