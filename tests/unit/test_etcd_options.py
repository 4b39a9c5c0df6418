"""The etcd backend's options: endpoint lists, TLS/auth checks, and secrets kept out of sight."""

from __future__ import annotations

import re

import pytest

from relaunch.launcher import LaunchConfig
from relaunch.rendezvous.api import RendezvousParameters
from relaunch.rendezvous.backends import get_rendezvous_handler
from relaunch.store.etcd import Endpoint, EtcdStore, parse_endpoints


def test_endpoints_are_a_comma_separated_list_with_a_default_port_and_scheme() -> None:
    assert parse_endpoints("a:1, b ,https://c:3/,[::1]:4") == [
        Endpoint("http", "a", 1),
        Endpoint("http", "b", 2379),
        Endpoint("https", "c", 3),
        Endpoint("http", "::1", 4),
    ]
    assert [str(e) for e in parse_endpoints("h:1,[::1]:2", "https")] == ["h:1", "[::1]:2"]
    assert parse_endpoints("h", "https")[0].scheme == "https"


@pytest.mark.parametrize(
    ("text", "protocol", "message"),
    [
        ("a:1,,b:2", "http", "expected HOST:PORT[,HOST:PORT...]"),
        ("a:x", "http", "has port 'x'"),
        ("ftp://a:1", "http", "scheme 'ftp': expected http or https"),
        ("a:1", "grpc", "protocol='grpc': expected http or https"),
    ],
)
def test_bad_endpoints_say_what_is_wrong(text: str, protocol: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_endpoints(text, protocol)


def test_half_given_credentials_are_refused() -> None:
    with pytest.raises(ValueError, match="both user and password"):
        EtcdStore("h:1", user="root")
    with pytest.raises(ValueError, match="key= needs cert="):
        EtcdStore("h:1", key="/k.pem")


def test_passwords_and_tokens_never_show_in_a_repr() -> None:
    store = EtcdStore("h:1,h:2", user="root", password="hunter2-secret")
    assert "hunter2-secret" not in repr(store) and "root" in repr(store)
    params = RendezvousParameters(
        "etcd", "h:1", "job", 1, 2, password="hunter2-secret", token="tok-secret", timeout=5
    )
    assert "secret" not in repr(params) and "'timeout': 5" in repr(params)
    config = LaunchConfig(
        1,
        2,
        1,
        rdzv_backend="etcd",
        rdzv_endpoint="h:1",
        rdzv_configs={"password": "hunter2-secret", "user": "root"},
    )
    assert "hunter2-secret" not in repr(config) and "'user': 'root'" in repr(config)


def test_tls_files_must_exist_before_anything_is_tried() -> None:
    params = RendezvousParameters("etcd", "h:1", "job", 1, 2, cacert="/no/such/ca.pem")
    with pytest.raises(ValueError, match=re.escape("cacert=/no/such/ca.pem: no such file")):
        get_rendezvous_handler(params)
