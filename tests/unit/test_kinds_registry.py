"""``rendezvous.kind_registry``: each dynamic backend's store kind, loaded on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relaunch.core.rendezvous.rdzv_conf import BACKENDS, STATIC_BACKEND
from relaunch.rendezvous.kind_registry import EndpointError, backend_names, kind_module


def test_every_dynamic_backend_has_a_kind_in_the_flags_order() -> None:
    assert backend_names() == ("c10d", "tcp", "etcd", "etcd-v2")
    assert backend_names() == tuple(name for name in BACKENDS if name != STATIC_BACKEND)


@pytest.mark.parametrize("backend", ["c10d", "tcp", "etcd", "etcd-v2"])
def test_each_kind_module_offers_what_the_launcher_guardian_and_status_ask(backend: str) -> None:
    kind = kind_module(backend)
    assert callable(kind.create_handler)
    assert callable(kind.write_death_notice)
    assert callable(kind.open_reader)
    assert kind.UNREACHABLE_HINT


def test_an_unknown_backend_has_no_kind() -> None:
    with pytest.raises(KeyError):
        kind_module("zookeeper")


def test_a_bad_endpoint_is_an_endpoint_error() -> None:
    from relaunch.core.rendezvous.rdzv_conf import RendezvousSettings

    with pytest.raises(EndpointError):
        kind_module("c10d").open_reader("host:99999", "j", RendezvousSettings(), 1.0, {})


def test_the_built_in_kind_loads_no_etcd_client() -> None:
    code = (
        "import sys; from relaunch.rendezvous.kind_registry import kind_module; "
        "kind_module('c10d'); from relaunch.rendezvous import backends; "
        "assert not [m for m in sys.modules if 'etcd' in m], sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
