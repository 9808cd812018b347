"""Settings for ``serve``: each flag has an environment twin, and all are validated once.

Validation happens before anything touches the node so that a typo in a DaemonSet
manifest fails the container at once with one readable line (exit code 2) instead of
a plugin that half-starts and never registers.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from pathlib import Path

from fuse_plugin.errors import EXIT_USAGE, Failure
from fuse_plugin.logs import FORMATS, LEVELS

ENV_PREFIX = "FUSE_DEVICE_PLUGIN_"
DEFAULT_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_RESOURCE_NAME = "github.com/fuse"
DEFAULT_FUSE_DEVICE = Path("/dev/fuse")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
# Why 1000: /dev/fuse is shared, so a slot is only a ticket. The kubelet never runs more
# pods than maxPods (110 by default, 250 on the largest managed-node presets), but each
# container that asks for the resource takes its own slot. 1000 covers the largest
# maxPods times a few FUSE containers per pod, and costs ~20 KB per ListAndWatch.
DEFAULT_SLOTS = 1000
MAX_SLOTS = 100_000
KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# Used with fullmatch: `$` would also match before a trailing newline.
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# A unix socket's path must fit sockaddr_un.sun_path (108 bytes with its NUL).
SOCKET_PATH_MAX = 107
PATH_MAX = 4095


@dataclass(frozen=True)
class Settings:
    device_plugin_dir: Path = DEFAULT_DEVICE_PLUGIN_DIR
    resource_name: str = DEFAULT_RESOURCE_NAME
    fuse_device: Path = DEFAULT_FUSE_DEVICE
    slots: int = DEFAULT_SLOTS
    log_format: str = "text"
    log_level: str = "info"
    metrics_port: int = 0
    metrics_address: str = "0.0.0.0"
    cdi: bool = False
    cdi_dir: Path = DEFAULT_CDI_DIR
    broker_dir: Path | None = None

    @property
    def socket_name(self) -> str:
        """Our endpoint's file name; derived from the resource so two plugins never collide."""
        return self.resource_name.replace("/", "_") + ".sock"

    @property
    def socket_path(self) -> Path:
        return self.device_plugin_dir / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET


def resource_name(text: str) -> str:
    """An extended resource name as the kubelet's ``IsExtendedResourceName`` judges it.

    Not native (no ``kubernetes.io/`` anywhere, a domain present), not starting with
    ``requests.``, and ``requests.<name>`` a qualified name: the quota name the API server
    derives from it must be valid too, which caps the domain at 244 characters. Anything
    else the kubelet refuses, and the plugin would retry Register for ever.
    """
    domain, sep, name = text.partition("/")
    if not sep or not domain or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an extended resource name: expected DOMAIN/NAME, "
            "e.g. github.com/fuse")
    if "kubernetes.io/" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the kubernetes.io domain is reserved for native resources")
    if text.startswith("requests."):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a name starting with 'requests.' is a quota name, not a resource")
    if len("requests." + domain) > 253 or not _DNS_SUBDOMAIN.fullmatch(domain):
        raise argparse.ArgumentTypeError(
            f"{text!r}: domain {domain!r} is not a lowercase DNS subdomain of at most "
            "244 characters")
    if len(name) > 63 or not _NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: name {name!r} must be 1-63 characters of [A-Za-z0-9-_.], "
            "starting and ending alphanumeric")
    return text


def _whole_number(text: str, low: int, high: int) -> int | None:
    """``text`` as a number from ``low`` to ``high`` if it is only ASCII digits, else None.

    ``int()`` alone is too lenient for a flag: it strips spaces and newlines and takes a
    sign, underscores and any script's digits ('\u0661\u0662' is 12), so a manifest's typo
    would be read as some number; ``str.isdigit()`` also takes '\u00b2', which ``int()``
    refuses. Leading zeros are allowed, and the length is checked before ``int()``, which
    refuses more than 4300 digits with an error of its own.
    """
    if not text or not text.isascii() or not text.isdigit():
        return None
    if len(text.lstrip("0")) > len(str(high)):
        return None
    value = int(text)
    return value if low <= value <= high else None


def _shown(text: str, limit: int = 100) -> str:
    """``text`` quoted for an error line, cut at ``limit`` characters: a 5000-digit value
    is one readable line, not a screenful."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def slots(text: str) -> int:
    value = _whole_number(text, 1, MAX_SLOTS)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 1 to {MAX_SLOTS}, got {_shown(text)}")
    return value


def port(text: str) -> int:
    value = _whole_number(text, 0, 65535)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be a TCP port from 0 to 65535, got {_shown(text)}")
    return value


def address(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an IP address such as 0.0.0.0 or 127.0.0.1, got {text!r}") from None
    return text


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return value in ("true", "1", "yes")


def absolute_path(text: str) -> Path:
    if not text or "\0" in text or not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be an absolute path, got {text[:100]!r}")
    try:
        encoded = text.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"must be valid UTF-8, got {text[:100]!r}") from None
    if len(encoded) > PATH_MAX:
        raise argparse.ArgumentTypeError(
            f"must be at most {PATH_MAX} bytes, got {len(encoded)}")
    return Path(text)


def plugin_dir(text: str) -> Path:
    """An absolute path gRPC can dial: its ``unix:`` targets split addresses at commas."""
    path = absolute_path(text)
    if "," in text:
        raise argparse.ArgumentTypeError(
            f"must not contain a comma (gRPC reads it as a list of addresses), got {text!r}")
    return path


def optional_path(text: str) -> Path | None:
    """An absolute path, or empty for "off"."""
    return absolute_path(text) if text else None


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text.lower() not in options:
            raise argparse.ArgumentTypeError(
                f"must be one of {', '.join(options)}, got {text!r}")
        return text.lower()
    return check


# flag, type, help: the one table the CLI and the env twins are built from; each flag
# is named after its Settings field, which holds the default.
SERVE_FLAGS: tuple[tuple[str, Callable[[str], object], str], ...] = (
    ("--device-plugin-dir", plugin_dir,
     "the kubelet's device-plugin directory (holds kubelet.sock)"),
    ("--resource-name", resource_name, "extended resource to advertise"),
    ("--fuse-device", absolute_path,
     "host FUSE device node handed to containers (must be char 10:229)"),
    ("--slots", slots, "how many containers may hold the shared device at once"),
    ("--log-format", choice(FORMATS), "log line format: text or json"),
    ("--log-level", choice(LEVELS), "debug, info, warning or error"),
    ("--metrics-port", port, "serve /metrics, /healthz and /readyz on this port; 0 turns it off"),
    ("--metrics-address", address, "address the metrics port binds to (IPv4 or IPv6)"),
    ("--cdi", boolean,
     "also write a CDI spec and answer Allocate with its device name (Kubernetes 1.28+)"),
    ("--cdi-dir", absolute_path, "where the CDI spec is written"),
    ("--broker-dir", optional_path,
     "broker mode: the broker's host directory, bound with its fusermount3 shim into "
     "every container (docs/broker.md); empty: off"),
)


def default(flag: str) -> object:
    """The default of a serve flag: its Settings field's."""
    name = flag.lstrip("-").replace("-", "_")
    return next(f.default for f in fields(Settings) if f.name == name)


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class _FromEnv(str):
    """A default read from the environment; argparse runs string defaults through `type`."""

    env = ""


def _checked(kind: Callable[[str], object]) -> Callable[[str], object]:
    def check(text: str) -> object:
        try:
            return kind(text)
        except argparse.ArgumentTypeError as err:
            if isinstance(text, _FromEnv):
                raise argparse.ArgumentTypeError(f"{err} (from ${text.env})") from None
            raise
    return check


def add_serve_flags(parser: argparse.ArgumentParser,
                    only: Collection[str] | None = None) -> None:
    """Add the serve flags (or ``only`` those); an environment twin supplies the default
    when set."""
    for flag, kind, help_text in SERVE_FLAGS:
        if only is not None and flag not in only:
            continue
        env = env_name(flag)
        value: object = default(flag)
        if env in os.environ:
            value = _FromEnv(os.environ[env])
            value.env = env
        # A boolean flag may stand alone (`--cdi`) or take a value (`--cdi false`).
        extra: dict[str, object] = {"nargs": "?", "const": True} if kind is boolean else {}
        parser.add_argument(flag, type=_checked(kind), default=value, **extra,  # type: ignore[arg-type]
                            help=f"{help_text} (env {env}; default: {default(flag)})")


def from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed serve flags (each field is named after its flag), with the
    checks that need two of them; raises ``Failure`` (exit 2)."""
    settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
    size = len(os.fsencode(settings.socket_path))
    if size > SOCKET_PATH_MAX:
        raise Failure(f"the plugin's socket {settings.socket_path} would be {size} bytes, "
                      f"more than a unix socket path holds ({SOCKET_PATH_MAX}): use a "
                      "shorter --device-plugin-dir or --resource-name", EXIT_USAGE)
    return settings
