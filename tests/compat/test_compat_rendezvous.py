"""relaunch.rendezvous beside torch.distributed.elastic.rendezvous: the endpoint parser, the
exception classes and where they are raised, and the handler registry a user's backend plugs
into."""

from __future__ import annotations

import pytest

from relaunch import rendezvous
from relaunch.endpoints import find_free_port, parse_endpoint
from relaunch.rendezvous import api as rdzv_api
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


# --- the exception classes, raised where torch raises them ---------------------------------

torch_rdzv = pytest.importorskip("torch.distributed.elastic.rendezvous")
torch_registry = pytest.importorskip("torch.distributed.elastic.rendezvous.registry")


def test_a_bad_store_value_is_a_state_error() -> None:
    error = rdzv_api.BadStoreValue("relaunch/job/r0/final", b"garbage", "not JSON")
    assert isinstance(error, rendezvous.RendezvousStateError)
    assert isinstance(error, rendezvous.RendezvousError)


@pytest.mark.timeout(60)
def test_a_join_timeout_is_a_timeout_error_in_both() -> None:
    """One node of the two a job needs waits ``join_timeout`` (1 s), then gives up."""
    import time

    ports = find_free_port(), find_free_port()
    theirs = torch_registry.get_rendezvous_handler(
        torch_rdzv.RendezvousParameters(
            "c10d", f"127.0.0.1:{ports[0]}", "timeout", 2, 2, join_timeout=1
        )
    )
    try:
        with pytest.raises(torch_rdzv.RendezvousTimeoutError):
            theirs.next_rendezvous()
    finally:
        theirs.shutdown()
    mine = rendezvous.get_rendezvous_handler(
        rendezvous.RendezvousParameters(
            "c10d", f"127.0.0.1:{ports[1]}", "timeout", 2, 2, join_timeout=1
        )
    )
    started = time.monotonic()
    try:
        with pytest.raises(rendezvous.RendezvousTimeoutError, match="waited 1s"):
            mine.next_rendezvous()
    finally:
        mine.shutdown()
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
def test_a_store_nobody_hosts_is_a_connection_error_in_both() -> None:
    dead = find_free_port()
    with pytest.raises(torch_rdzv.RendezvousConnectionError):
        torch_registry.get_rendezvous_handler(
            torch_rdzv.RendezvousParameters(
                "c10d", f"127.0.0.1:{dead}", "nohost", 1, 2, is_host=False, read_timeout=1
            )
        )
    with pytest.raises(rendezvous.RendezvousConnectionError, match="nohost"):
        rendezvous.get_rendezvous_handler(
            rendezvous.RendezvousParameters(
                "c10d", f"127.0.0.1:{dead}", "nohost", 1, 2, is_host=False, join_timeout=1
            )
        )


# --- the registry a user's backend plugs into ------------------------------------------------


class _OwnHandler(rendezvous.RendezvousHandler):
    """A user's own backend: one node, the workers' store where the user says."""

    def __init__(self, params: rendezvous.RendezvousParameters) -> None:
        self.params = params

    def next_rendezvous(self) -> rendezvous.RendezvousInfo:
        return rendezvous.RendezvousInfo(
            None, 0, 1, rendezvous.RendezvousStoreInfo("127.0.0.1", 29500)
        )

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id


def _own(params: rendezvous.RendezvousParameters) -> rendezvous.RendezvousHandler:
    return _OwnHandler(params)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> rendezvous.RendezvousHandlerRegistry:
    """The global registry, its registrations undone after the test."""
    shared = rendezvous.rendezvous_handler_registry
    monkeypatch.setattr(shared, "_registry", dict(shared._registry))
    return shared


def test_a_registered_backend_is_built_by_get_rendezvous_handler(registry) -> None:
    from relaunch.rendezvous import registry as registry_module

    registry.register("own", _own)
    params = rendezvous.RendezvousParameters("own", "", "job", 1, 1, flavour="x")
    handler = registry_module.get_rendezvous_handler(params)
    assert isinstance(handler, _OwnHandler) and handler.params is params
    assert rendezvous.get_rendezvous_handler(params).next_rendezvous().world_size == 1
    registry.register("own", _own)  # the same creator again: nothing changes


def test_the_built_in_backends_are_registered(registry) -> None:
    for backend in rendezvous.BACKENDS:
        with pytest.raises(ValueError, match=f"{backend!r} is already registered"):
            registry.register(backend, _own)


def test_registry_errors_are_torchs_types() -> None:
    """Each misuse raises what torch's registry raises, with relaunch's one-line message."""
    cases = [
        ("an empty name", lambda r: r.register("", _own), ValueError),
        ("a second creator", lambda r: (r.register("x", _own), r.register("x", print)), ValueError),
        ("an unknown backend", lambda r: r.create_handler(_params(r, "y")), ValueError),
        (
            "a handler of another backend",
            lambda r: (
                r.register("z", lambda p: _OwnHandler(_params(r, "w"))),
                r.create_handler(_params(r, "z")),
            ),
            RuntimeError,
        ),
    ]
    for what, misuse, error in cases:
        with pytest.raises(error):
            misuse(torch_rdzv.RendezvousHandlerRegistry())
        with pytest.raises(error) as raised:
            misuse(rendezvous.RendezvousHandlerRegistry())
        assert "\n" not in str(raised.value), what


def _params(registry: object, backend: str) -> object:
    """Parameters of ``registry``'s side (torch's or relaunch's)."""
    side = rendezvous if isinstance(registry, rendezvous.RendezvousHandlerRegistry) else torch_rdzv
    return side.RendezvousParameters(backend, "", "job", 1, 1)


def test_get_as_bool_and_get_as_int_read_as_torchs() -> None:
    values = [True, False, 1, 0, "1", "0", "true", "False", "T", "f", "yes", "No", "y", "n", None]
    for value in values:
        mine = rendezvous.RendezvousParameters("c10d", "", "j", 1, 1, key=value)
        theirs = torch_rdzv.RendezvousParameters("c10d", "", "j", 1, 1, key=value)
        assert mine.get_as_bool("key") == theirs.get_as_bool("key"), value
    for bad in ["maybe", 2, 1.0, ""]:
        mine = rendezvous.RendezvousParameters("c10d", "", "j", 1, 1, key=bad)
        theirs = torch_rdzv.RendezvousParameters("c10d", "", "j", 1, 1, key=bad)
        with pytest.raises(ValueError):
            theirs.get_as_bool("key")
        with pytest.raises(ValueError, match="key="):
            mine.get_as_bool("key")
    for value in [3, "42", " 7 ", None]:
        mine = rendezvous.RendezvousParameters("c10d", "", "j", 1, 1, n=value)
        theirs = torch_rdzv.RendezvousParameters("c10d", "", "j", 1, 1, n=value)
        assert mine.get_as_int("n") == theirs.get_as_int("n")
    assert rendezvous.RendezvousParameters("c10d", "", "j", 1, 1).get_as_int("n", 5) == 5
    with pytest.raises(ValueError, match="n='x': expected an integer"):
        rendezvous.RendezvousParameters("c10d", "", "j", 1, 1, n="x").get_as_int("n")
