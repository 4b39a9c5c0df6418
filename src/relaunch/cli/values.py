"""The text of one flag (or its ``PET_*`` variable) into its value; ConfigError otherwise.

``relaunch.cli.flags`` hands these to argparse, which reports their messages as usage errors.
"""

from __future__ import annotations

import ipaddress
import math
import re
import signal

from relaunch.config import ConfigError
from relaunch.core.defaults import MAX_SECONDS
from relaunch.core.workers.streams import Std
from relaunch.endpoints import is_loopback, parse_endpoint


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(f"expected N or MIN:MAX with whole numbers >= 1, got {text!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise ConfigError(f"MIN must not exceed MAX, got {text!r}")
    return low, high


def parse_command(text: str) -> str:
    """A shell command (``--health-check``): not blank."""
    if not text.strip():
        raise ConfigError("expected a shell command, got an empty one")
    return text


def parse_nproc(text: str) -> str:
    """A number of workers >= 1, ``cpu``, ``gpu``, ``auto``, or ``gpu:LIST``: one worker per
    listed GPU, ``gpu:1,3`` or ``gpu:0-3`` (``relaunch.cli.devices.parse_device_request``),
    in its canonical spelling (``gpu:0,1,2,3``)."""
    from relaunch.cli.devices import parse_device_request

    try:
        return str(parse_device_request(text))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_count(text: str, minimum: int) -> int:
    """A whole number >= ``minimum``."""
    digits = text.strip().removeprefix("-")
    if digits.isdecimal() and digits.isascii() and int(text) >= minimum:
        return int(text)
    raise ConfigError(f"expected a whole number >= {minimum}, got {text!r}")


def parse_size(text: str) -> int:
    """A number of bytes: ``8G``, ``512M``, ``1.5GiB`` or plain bytes (``--state-memory``)."""
    from relaunch.core.workers.state_settings import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_preload(text: str) -> tuple[str, ...]:
    """``--preload``: module names, comma-separated (``torch,numpy``); none imported here."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise ConfigError(f"expected module names, comma-separated (torch,numpy), got {text!r}")
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"{name!r} is not a module name (dotted Python names: torch.nn)")
    return names


def parse_seconds(text: str, positive: bool) -> float:
    """A number of seconds, > 0 when ``positive``, else >= 0, and at most ``MAX_SECONDS``
    (``inf`` and ``nan`` are not durations: every wait must fit the kernel's)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= MAX_SECONDS) or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(
            f"expected a number of seconds {bound} and at most {MAX_SECONDS:.0f} (about 11 "
            f"days), got {text!r}"
        )
    return value


def parse_backoff(text: str) -> tuple[float, float]:
    """``BASE:MAX`` seconds (``BASE`` alone: up to 30 s); ``0`` turns the backoff off."""
    base_text, _, cap_text = text.partition(":")
    try:
        base = float(base_text)
        cap = float(cap_text) if cap_text else max(base, 30.0)
    except ValueError:
        base = cap = -1.0
    if not (0 <= base <= cap <= MAX_SECONDS):
        raise ConfigError(
            f"expected BASE:MAX seconds with 0 <= BASE <= MAX <= {MAX_SECONDS:.0f}, got {text!r}"
        )
    return base, cap


def parse_factor(text: str) -> float:
    """A finite factor > 1."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not (value > 1 and math.isfinite(value)):
        raise ConfigError(f"expected a number > 1, got {text!r}")
    return value


def parse_bound(text: str) -> float:
    """A bound in seconds: finite and > 0 (a wait that must end)."""
    return parse_seconds(text, True)


def parse_std(text: str) -> Std | dict[int, Std]:
    """A stream mask for ``--redirects``/``--tee``: ``3``, or per rank ``0:1,1:2``."""
    try:
        return Std.from_str(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}``."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"expected KEY=VALUE[,KEY=VALUE...], got {text!r}")
        conf[key.strip()] = value.strip()
    return conf


def parse_host(text: str) -> str:
    """A host name or an IP address (``--master-addr``, ``--local-addr``): one a socket can be
    given (a name IDNA can encode, of letters, digits, '.', '-' and '_'); "" is left as it is."""
    if not text:
        return text
    try:
        ipaddress.ip_address(text[1:-1] if text.startswith("[") else text)
        return text
    except ValueError:
        pass
    try:
        encoded = text.encode("idna")
    except UnicodeError:
        encoded = b""
    if not (re.fullmatch(rb"[A-Za-z0-9._-]{1,253}", encoded) and not encoded.startswith(b".")):
        raise ConfigError(f"expected a host name or an IP address, got {text!r}")
    return text


def parse_rdzv_endpoint(text: str) -> str:
    """``HOST:PORT``, or for etcd a list of members ``HOST:PORT,HOST:PORT`` (``http(s)://``)."""
    for item in text.split(",") if text else ():
        try:
            host, _ = parse_endpoint(item.partition("://")[2] or item, default_port=0)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        parse_host(host)
    return text


def parse_metrics_port(text: str) -> tuple[str, int]:
    """``PORT`` (every interface), ``ADDR:PORT`` or ``[V6]:PORT``: where to serve metrics."""
    text = text.strip()
    try:
        host, port = ("", int(text)) if text.isdigit() else parse_endpoint(text, default_port=-1)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"expected [ADDR:]PORT with a port 0..65535, got {text!r}")
    return host, port


def parse_ranks_filter(text: str) -> set[int]:
    """Local ranks such as ``0,3``."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(item.isdigit() for item in items):
        raise ConfigError(f"expected local ranks such as 0,3, got {text!r}")
    return {int(item) for item in items}


def parse_filters(text: str) -> list[str]:
    """torchrun's duplicate filters: strings separated by commas, ``,,`` for a comma."""
    marker = "\0"
    return [item.replace(marker, ",") for item in text.replace(",,", marker).split(",")]


#: The entry-point group torchrun loads ``--logs-specs`` classes from.
LOGS_SPECS_GROUP = "torchrun.logs_specs"


def parse_logs_specs(name: str) -> type:
    """The ``LogsSpecs`` class named ``name`` in the ``torchrun.logs_specs`` entry points (as
    torchrun's ``--logs-specs``); ``importlib.metadata`` is read only when the flag is given.
    ``default`` (torch's own entry point, its ``DefaultLogsSpecs``) is relaunch's
    ``DefaultLogsSpecs``: the same files, without importing torch."""
    if name == "default":
        from relaunch.procs.logs_specs import DefaultLogsSpecs

        return DefaultLogsSpecs
    from importlib.metadata import entry_points

    group = entry_points(group=LOGS_SPECS_GROUP)
    found = [point for point in group if point.name == name]
    if not found:
        known = ", ".join(sorted({point.name for point in group})) or "none are installed"
        raise ConfigError(
            f"no {LOGS_SPECS_GROUP} entry point is named {name!r} (known: {known}): install "
            "the package that declares it, or leave --logs-specs out"
        )
    try:
        loaded = found[0].load()
    except Exception as exc:
        raise ConfigError(
            f"{LOGS_SPECS_GROUP} entry point {name!r} ({found[0].value}) cannot be loaded: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(loaded, type) or not callable(getattr(loaded, "reify", None)):
        raise ConfigError(
            f"{LOGS_SPECS_GROUP} entry point {name!r} ({found[0].value}) is not a LogsSpecs "
            "class (one with reify(envs))"
        )
    return loaded


#: Signals no process can catch: relaunch cannot stop its workers on them.
UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def parse_signals(text: str) -> list[signal.Signals]:
    """Signals by name (``SIGTERM``, ``term``) or number, comma-separated; not SIGKILL or SIGSTOP,
    which no process can catch."""
    found = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name = item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"
        try:
            number = item.isdecimal() and item.isascii()
            sig = signal.Signals(int(item)) if number else signal.Signals[name]
        except (KeyError, ValueError):
            raise ConfigError(
                f"unknown signal {item!r}: expected names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT"
            ) from None
        if sig in UNCATCHABLE:
            raise ConfigError(
                f"{sig.name} cannot be handled: no process can catch it (relaunch could not stop "
                "its workers first); use SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 or SIGUSR2"
            )
        found.append(sig)
    return found


def parse_loopback(text: str) -> str:
    """A loopback address, for the standalone store (``relaunch store --host``)."""
    if not is_loopback(text):
        raise ConfigError(
            f"the standalone store listens on loopback only, got {text!r}: use 127.0.0.1"
        )
    return text
