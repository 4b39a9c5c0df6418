"""``--rdzv-conf``: the rendezvous keys, read once into a typed, checked value. Pure.

Each backend reads its own keys (``known_keys``; the ``relaunch`` command refuses any other,
naming the closest, where torchrun ignores it: ``unknown_key``):

- ``static``: ``rank`` (``--node-rank``) and ``join_timeout`` (how long the master's name may
  take to resolve); it ignores the dynamic rendezvous' keys;
- ``c10d``/``tcp``: the dynamic rendezvous' keys (``RendezvousSettings``), ``rank`` among them:
  the node's place in the scheduler's order, which group ranks follow;
- ``etcd``/``etcd-v2``: those, and the etcd client's (``EtcdOptions``);
- a store kind of ``STORE_KINDS``: the dynamic rendezvous' keys, and etcd's where it says so.

``parse`` is the one reader of these keys and the one place each is range-checked; the values go
down to the handler as they are. It raises ``ValueError`` with the message the ``relaunch``
command prints (``relaunch.config`` makes it a ``ConfigError``). A new key is a field of
``RendezvousSettings`` (or ``EtcdOptions``) and its line in ``_dynamic`` (or ``_etcd``).
"""

# Annotations evaluated, not postponed: a named tuple's field types are then classes,
# where strings made typing compile a forward reference for each field at every start.

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from relaunch.core.defaults import MAX_SECONDS
from relaunch.core.rendezvous import node_order
from relaunch.core.rendezvous import rounds as plan
from relaunch.core.run import exclusion
from relaunch.core.value import Value

#: The dynamic rendezvous on the built-in store, on etcd, and the fixed one, by
#: ``--rdzv-backend`` name. ``etcd-v2`` is torchrun's name for the dynamic rendezvous on etcd;
#: relaunch speaks etcd's v3 API under both names.
C10D_BACKENDS = ("c10d", "tcp")
#: The store's port when a c10d ``--rdzv-endpoint`` names none (torchrun's).
C10D_DEFAULT_PORT = 29400
ETCD_BACKENDS = ("etcd", "etcd-v2")
STATIC_BACKEND = "static"


class RegisteredKind(Value):
    """A store kind of the dynamic rendezvous: the ``--rdzv-backend`` names it answers to, the
    module that runs it (``rendezvous.kind_registry`` loads it when the backend is asked for),
    and whether its settings include the etcd client's keys (``EtcdOptions``)."""

    __slots__ = ("etcd_keys", "module", "names")

    names: tuple[str, ...]
    module: str
    etcd_keys: bool

    def __init__(self, names: tuple[str, ...], module: str, etcd_keys: bool = False) -> None:
        self._set(names=names, module=module, etcd_keys=etcd_keys)


#: The store kinds, one line a kind: a new kind is its line, its module and its store.
STORE_KINDS = (
    RegisteredKind(C10D_BACKENDS, "relaunch.rendezvous.kinds_c10d"),
    RegisteredKind(ETCD_BACKENDS, "relaunch.rendezvous.kinds_etcd", etcd_keys=True),
)
#: Every backend this release can run.
BACKENDS = (*(name for kind in STORE_KINDS for name in kind.names), STATIC_BACKEND)


def registered_kind(backend: str) -> RegisteredKind | None:
    """The store kind that answers to ``backend`` (None: ``static``, or no backend)."""
    return next((kind for kind in STORE_KINDS if backend in kind.names), None)


#: ``--rdzv-conf`` keys whose values never appear in a repr, a log line or an error message.
SECRET_KEYS = ("password", "token")
#: The environment variable that holds the built-in store's shared token (``--rdzv-conf token``
#: wins over it).
TOKEN_ENV = "RELAUNCH_RDZV_TOKEN"


def failover_without_token(hosts: int) -> str:
    """What a job is told whose ``--rdzv-endpoint`` names ``hosts`` hosts (the built-in
    store's failover) with no token: failover trusts the votes and copies of every peer."""
    return (
        f"--rdzv-endpoint names {hosts} hosts, which turns on the store's failover, and failover "
        "needs a token on every node: without one, anyone who reaches a standby can read the "
        "job's store, split the job in two or turn failover off; set the same --rdzv-conf "
        f"token=SECRET (or {TOKEN_ENV}) on every node, or name one host"
    )


def redacted(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``conf`` with the values of secret keys (passwords, tokens) masked."""
    return {key: "***" if key in SECRET_KEYS else value for key, value in conf.items()}


def _masked(value: NamedTuple, secrets: tuple[str, ...]) -> str:
    """``value``'s repr with the values of ``secrets`` masked."""
    shown = (
        f"{name}={'***' if name in secrets and item is not None else repr(item)}"
        for name, item in zip(type(value)._fields, value, strict=True)
    )
    return f"{type(value).__name__}({', '.join(shown)})"


# Named tuples, not ``core.value.Value``s: ``_masked`` shows them by their ``_fields``, and the
# settings are read by ``_replace`` and their ``_fields`` name the ``--rdzv-conf`` keys.


class EtcdOptions(NamedTuple):
    """The etcd client's ``--rdzv-conf`` keys: ``protocol``, TLS files, credentials."""

    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        return _masked(self, SECRET_KEYS)


class RendezvousSettings(NamedTuple):
    """The ``--rdzv-conf`` keys, typed and checked, with torchrun's defaults."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    #: Seconds each store operation may take.
    timeout: float = 60.0
    #: Host the store on this node: None (not given) hosts it when the endpoint can be bound.
    is_host: bool | None = None
    #: The job's shared secret (else ``$RELAUNCH_RDZV_TOKEN``: ``job_token``): the built-in
    #: store's, and what the copies of kept state between nodes prove.
    token: str | None = None
    #: This node's name within its host, for the job's record of it (``core.run.exclusion``).
    node_name: str | None = None
    #: Failures a node may cause before it is excluded (0: never), and for how many seconds.
    exclude_after: int = exclusion.DEFAULT_EXCLUDE_AFTER
    exclude_cooldown: float = exclusion.DEFAULT_EXCLUDE_COOLDOWN
    #: This node's rank (``--node-rank``, or what the scheduler says): the static backend's
    #: group rank; the dynamic one orders its nodes by it (``core.rendezvous.node_order``). None:
    #: not given.
    rank: int | None = None
    #: The etcd client's keys (None: not an etcd backend).
    etcd: EtcdOptions | None = None

    def __repr__(self) -> str:
        return _masked(self, SECRET_KEYS)

    def job_token(self, environ: Mapping[str, str]) -> str | None:
        """The job's token: ``token``, else ``$RELAUNCH_RDZV_TOKEN``; None if neither."""
        return self.token or environ.get(TOKEN_ENV) or None

    def round_settings(self, min_nodes: int, max_nodes: int) -> plan.Settings:
        """The dynamic rendezvous' decisions' settings for a job of ``min_nodes:max_nodes``."""
        return plan.Settings(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            keep_alive_interval=self.keep_alive_interval,
            keep_alive_max_attempt=self.keep_alive_max_attempt,
        )

    def etcd_store_arguments(self) -> dict[str, Any]:
        """``EtcdStore``'s keyword arguments: the etcd keys and ``timeout``."""
        etcd = self.etcd or EtcdOptions()
        return {
            "protocol": etcd.protocol,
            "cacert": etcd.cacert,
            "cert": etcd.cert,
            "key": etcd.key,
            "user": etcd.user,
            "password": etcd.password,
            "timeout": self.timeout,
        }


class RendezvousSpec(Value):
    """Which rendezvous this node joins, and how: the ``--rdzv-*`` flags, typed (torch's
    ``RendezvousParameters``, its ``config`` read into ``settings``)."""

    __slots__ = (
        "backend",
        "endpoint",
        "local_addr",
        "max_nodes",
        "min_nodes",
        "run_id",
        "settings",
    )

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    settings: RendezvousSettings
    local_addr: str | None

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        settings: RendezvousSettings,
        local_addr: str | None = None,
    ) -> None:
        self._set(backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=min_nodes)
        self._set(max_nodes=max_nodes, settings=settings, local_addr=local_addr)


def parse(
    backend: str, conf: Mapping[str, Any], is_file: Callable[[str], bool]
) -> RendezvousSettings:
    """The keys of ``conf`` that ``backend`` reads, typed and checked; ValueError saying which
    is wrong. ``is_file(path)`` tells whether a TLS file named for etcd exists."""
    rank = None
    if conf.get("rank") is not None:
        rank = _number(conf, "rank", 0, whole=True)
        if not 0 <= rank < node_order.MAX_NODE_RANK:
            raise ValueError(f"--node-rank {rank} must be >= 0 and below 2**31")
    if backend == STATIC_BACKEND:
        # The one dynamic key the static backend reads: how long the master's name may take to
        # resolve (rendezvous.static).
        timing = _dynamic({"join_timeout": conf.get("join_timeout", 600)})
        return RendezvousSettings(join_timeout=timing.join_timeout, rank=rank or 0)
    kind = registered_kind(backend)
    if kind is not None:
        settings = _dynamic(conf)._replace(rank=rank)
        return settings._replace(etcd=_etcd(conf, is_file)) if kind.etcd_keys else settings
    raise ValueError(
        f"unknown rendezvous backend {backend!r}: valid backends are " + ", ".join(BACKENDS)
    )


#: Keys torch's own backends read that relaunch takes and has no use for, so that a torchrun
#: command line runs unchanged: its store's read timeout and type, its close and heartbeat
#: timeouts, and its etcd-v2 prefix and TLS names.
TORCH_ONLY_KEYS = (
    "read_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "store_type",
    "etcd_prefix",
    "ssl_cert",
    "ssl_cert_key",
    "ca_cert",
)


def known_keys(backend: str) -> tuple[str, ...] | None:
    """The ``--rdzv-conf`` keys ``backend`` reads (None: a backend that is not built in, whose
    keys are its own to read)."""
    if backend == STATIC_BACKEND:
        return ("rank", "join_timeout")
    kind = registered_kind(backend)
    if kind is None:
        return None
    own = tuple(name for name in RendezvousSettings._fields if name != "etcd")
    return own + (EtcdOptions._fields if kind.etcd_keys else ())


def unknown_key(backend: str, conf: Mapping[str, Any]) -> str | None:
    """What is wrong with the first key of ``conf`` that ``backend`` does not take (a typo is
    silently ignored otherwise), naming the closest it takes; None when every key is taken.
    Besides the keys it reads, a backend takes torch's (``TORCH_ONLY_KEYS``), and ``static``
    those of the dynamic backends, which it ignores."""
    reads = known_keys(backend)
    if reads is None:
        return None
    taken = (*reads, *TORCH_ONLY_KEYS)
    if backend == STATIC_BACKEND:
        taken += (*RendezvousSettings._fields, *EtcdOptions._fields)
    for key in conf:
        if key in taken:
            continue
        import difflib

        closest = difflib.get_close_matches(key, taken, n=1)
        fix = f"did you mean {closest[0]}?" if closest else "it reads " + ", ".join(reads)
        return f"--rdzv-conf {key}: not a key of the {backend} backend: {fix}"
    return None


def _number(conf: Mapping[str, Any], key: str, default: float, whole: bool = False) -> Any:
    value = conf.get(key, default)
    try:
        return int(value) if whole else float(value)
    except (TypeError, ValueError):
        kind = "a whole number" if whole else "a number of seconds"
        raise ValueError(f"--rdzv-conf {key}={value!r}: expected {kind}") from None


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _text(conf: Mapping[str, Any], key: str) -> str | None:
    """A text key: None when not given or empty."""
    value = conf.get(key)
    return str(value) if value else None


def _dynamic(conf: Mapping[str, Any]) -> RendezvousSettings:
    """The dynamic rendezvous' keys."""
    settings = RendezvousSettings(
        join_timeout=_number(conf, "join_timeout", 600),
        last_call_timeout=_number(conf, "last_call_timeout", 30),
        keep_alive_interval=_number(conf, "keep_alive_interval", 5),
        keep_alive_max_attempt=_number(conf, "keep_alive_max_attempt", 3, whole=True),
        timeout=_number(conf, "timeout", 60),
        is_host=None if conf.get("is_host") is None else _truthy(conf["is_host"]),
        token=_text(conf, "token"),
        node_name=_text(conf, "node_name"),
        exclude_after=_number(conf, "exclude_after", exclusion.DEFAULT_EXCLUDE_AFTER, whole=True),
        exclude_cooldown=_number(conf, "exclude_cooldown", exclusion.DEFAULT_EXCLUDE_COOLDOWN),
    )
    if settings.node_name is not None and not exclusion.valid_node_name(settings.node_name):
        raise ValueError(
            f"--rdzv-conf node_name={settings.node_name!r}: expected 1 to 64 letters, digits, "
            "'.', '_' or '-'"
        )
    if settings.exclude_after < 0:
        raise ValueError(
            f"--rdzv-conf exclude_after={conf['exclude_after']!r}: expected a whole number >= 0"
        )
    if not 0 < settings.exclude_cooldown <= MAX_SECONDS:
        raise ValueError(
            f"--rdzv-conf exclude_cooldown={conf['exclude_cooldown']!r}: expected a number of "
            "seconds > 0"
        )
    for key in ("join_timeout", "last_call_timeout", "keep_alive_interval", "timeout"):
        if not 0 < getattr(settings, key) <= MAX_SECONDS:  # nan and inf are not durations
            raise ValueError(
                f"--rdzv-conf {key}={conf[key]!r}: expected a number of seconds > 0 and at most "
                f"{MAX_SECONDS:.0f}"
            )
    if settings.keep_alive_max_attempt < 1:
        raise ValueError(
            f"--rdzv-conf keep_alive_max_attempt={conf['keep_alive_max_attempt']!r}: "
            "expected a whole number >= 1"
        )
    return settings


def _etcd(conf: Mapping[str, Any], is_file: Callable[[str], bool]) -> EtcdOptions:
    """The etcd client's keys."""
    options = EtcdOptions(
        protocol=str(conf.get("protocol", "http")),
        cacert=_path(conf, "cacert"),
        cert=_path(conf, "cert"),
        key=_path(conf, "key"),
        user=None if conf.get("user") is None else str(conf["user"]),
        password=None if conf.get("password") is None else str(conf["password"]),
    )
    if options.protocol not in ("http", "https"):
        raise ValueError(f"--rdzv-conf protocol={options.protocol!r}: expected http or https")
    for name in ("cacert", "cert", "key"):
        path = getattr(options, name)
        if path is not None and not is_file(path):
            raise ValueError(f"--rdzv-conf {name}={path}: no such file")
    if (options.user is None) != (options.password is None):
        raise ValueError("--rdzv-conf: etcd authentication needs both user and password")
    if options.key is not None and options.cert is None:
        raise ValueError("--rdzv-conf: etcd TLS: key= needs cert= too")
    return options


def _path(conf: Mapping[str, Any], key: str) -> str | None:
    value = conf.get(key)
    return None if value is None else str(value)
