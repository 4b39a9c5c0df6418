"""What the Python API and the ``--rdzv-conf`` keys say of a mistake: one line before anything
starts; a registered backend's own keys pass through untouched; a signal the agent handles is
handled whatever disposition the process inherited."""

from __future__ import annotations

import signal

import pytest

from relaunch.config import ConfigError
from relaunch.core.rendezvous.rdzv_conf import (
    BACKENDS,
    TORCH_ONLY_KEYS,
    EtcdOptions,
    RendezvousSettings,
    known_keys,
    unknown_key,
)
from relaunch.launcher import LaunchConfig, elastic_launch, rendezvous_handler
from relaunch.procs.signals import (
    SIGNALS_TO_HANDLE_ENV,
    SignalsToExceptions,
    raise_signal_exception,
)
from relaunch.rendezvous import api as rendezvous
from relaunch.rendezvous import rendezvous_handler_registry


def _never_run() -> None:
    raise AssertionError("the entrypoint ran")


def test_a_static_config_without_an_endpoint_is_one_line_naming_the_field() -> None:
    """As torch's launch_agent, which refuses it too (c10d and etcd default to this host)."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    with pytest.raises(ConfigError) as raised:
        elastic_launch(config, _never_run)()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("LaunchConfig.rdzv_endpoint is empty: the static backend needs")
    assert "rdzv_endpoint='127.0.0.1:0'" in message


def test_every_key_a_built_in_backend_reads_is_known() -> None:
    dynamic = set(RendezvousSettings._fields) - {"etcd"}
    for backend in BACKENDS:
        keys = known_keys(backend)
        assert keys is not None
        assert unknown_key(backend, dict.fromkeys((*keys, *TORCH_ONLY_KEYS), "1")) is None
        if backend == "static":
            assert keys == ("rank", "join_timeout")
            assert unknown_key(backend, dict.fromkeys((*dynamic, *EtcdOptions._fields))) is None
            continue
        assert dynamic <= set(keys)
        assert (set(EtcdOptions._fields) <= set(keys)) == backend.startswith("etcd")


def test_an_unknown_key_names_the_closest() -> None:
    assert unknown_key("c10d", {"join_timeout": 1, "keep_alive_intreval": 2}) == (
        "--rdzv-conf keep_alive_intreval: not a key of the c10d backend: did you mean "
        "keep_alive_interval?"
    )
    assert unknown_key("etcd-v2", {"pasword": "x"}) == (
        "--rdzv-conf pasword: not a key of the etcd-v2 backend: did you mean password?"
    )
    assert unknown_key("c10d", {"cacert": "x"}) is not None  # etcd's, not the built-in store's


class _OwnHandler(rendezvous.RendezvousHandler):
    def __init__(self, params: rendezvous.RendezvousParameters) -> None:
        self.params = params

    def next_rendezvous(self) -> rendezvous.RendezvousInfo:
        raise AssertionError("not joined here")

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id


def test_the_keys_of_a_registered_backend_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        rendezvous_handler_registry, "_registry", dict(rendezvous_handler_registry._registry)
    )
    rendezvous_handler_registry.register("own_i45", _OwnHandler)
    conf = {"flavour": "x", "join_timout": "5"}
    assert unknown_key("own_i45", conf) is None
    config = LaunchConfig(1, 1, 1, rdzv_backend="own_i45", rdzv_configs=conf, run_id="j")
    handler = rendezvous_handler(config)
    assert isinstance(handler, _OwnHandler)
    assert handler.params.config["flavour"] == "x"
    assert handler.params.config["join_timout"] == "5"


@pytest.mark.parametrize("named", ["SIGTERM,SIGINT", ""])
def test_an_inherited_ignore_gives_way_to_a_signal_launch_agent_names(
    monkeypatch: pytest.MonkeyPatch, named: str
) -> None:
    """``launch_agent`` names its signals in TORCHELASTIC_SIGNALS_TO_HANDLE, as torch's: each
    is handled even if ignored (a background job's SIGINT); one it does not name and that is
    ignored (nohup's SIGHUP) stays ignored; both are put back after."""
    monkeypatch.setenv(SIGNALS_TO_HANDLE_ENV, named)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the autouse fixture puts the handlers back
    signals = SignalsToExceptions()
    signals.install()
    expected = raise_signal_exception if named else signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == expected
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    signals.restore()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
