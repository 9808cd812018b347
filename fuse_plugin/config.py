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
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from fuse_plugin.logs import FORMATS, LEVELS

ENV_PREFIX = "FUSE_DEVICE_PLUGIN_"
DEFAULT_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_RESOURCE_NAME = "github.com/fuse"
DEFAULT_FUSE_DEVICE = Path("/dev/fuse")
# Why 1000: /dev/fuse is shared, so a slot is only a ticket. The kubelet never runs more
# pods than maxPods (110 by default, 250 on the largest managed-node presets), but each
# container that asks for the resource takes its own slot. 1000 covers the largest
# maxPods times a few FUSE containers per pod, and costs ~20 KB per ListAndWatch.
DEFAULT_SLOTS = 1000
MAX_SLOTS = 100_000
KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


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
    cdi_dir: Path = Path("/var/run/cdi")
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
    """An extended resource name the kubelet accepts: ``<dns-subdomain>/<name>``.

    The kubelet refuses names without a domain and names in the kubernetes.io
    domains (those are native resources), so catch that here rather than in a
    Register retry loop.
    """
    domain, sep, name = text.partition("/")
    if not sep or not domain or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an extended resource name: expected DOMAIN/NAME, "
            "e.g. github.com/fuse")
    if len(domain) > 253 or not _DNS_SUBDOMAIN.match(domain):
        raise argparse.ArgumentTypeError(
            f"{text!r}: domain {domain!r} is not a lowercase DNS subdomain")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the kubernetes.io domain is reserved for native resources")
    if len(name) > 63 or not _NAME.match(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: name {name!r} must be 1-63 characters of [A-Za-z0-9-_.], "
            "starting and ending alphanumeric")
    return text


def slots(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SLOTS or str(value) != text.strip():
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 1 to {MAX_SLOTS}, got {text!r}")
    return value


def port(text: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 to 65535, got {text!r}")
    return int(text)


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
        raise argparse.ArgumentTypeError(f"must be an absolute path, got {text!r}")
    return Path(text)


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


# flag, type, default, help: the one table the CLI and the env twins are built from.
SERVE_FLAGS: tuple[tuple[str, Callable[[str], object], object, str], ...] = (
    ("--device-plugin-dir", absolute_path, DEFAULT_DEVICE_PLUGIN_DIR,
     "the kubelet's device-plugin directory (holds kubelet.sock)"),
    ("--resource-name", resource_name, DEFAULT_RESOURCE_NAME,
     "extended resource to advertise"),
    ("--fuse-device", absolute_path, DEFAULT_FUSE_DEVICE,
     "host FUSE device node handed to containers (must be char 10:229)"),
    ("--slots", slots, DEFAULT_SLOTS,
     "how many containers may hold the shared device at once"),
    ("--log-format", choice(FORMATS), "text", "log line format: text or json"),
    ("--log-level", choice(LEVELS), "info", "debug, info, warning or error"),
    ("--metrics-port", port, 0,
     "serve /metrics, /healthz and /readyz on this port; 0 turns it off"),
    ("--metrics-address", address, "0.0.0.0", "address the metrics port binds to"),
    ("--cdi", boolean, False,
     "also write a CDI spec and answer Allocate with its device name (Kubernetes 1.28+)"),
    ("--cdi-dir", absolute_path, Path("/var/run/cdi"), "where the CDI spec is written"),
    ("--broker-dir", optional_path, None,
     "broker mode: the broker's host directory, bound with its fusermount3 shim into "
     "every container (docs/broker.md); empty: off"),
)


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


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Add the serve flags; an environment twin supplies the default when set."""
    for flag, kind, default, help_text in SERVE_FLAGS:
        env = env_name(flag)
        value: object = default
        if env in os.environ:
            value = _FromEnv(os.environ[env])
            value.env = env
        # A boolean flag may stand alone (`--cdi`) or take a value (`--cdi false`).
        extra: dict[str, object] = {"nargs": "?", "const": True} if kind is boolean else {}
        parser.add_argument(flag, type=_checked(kind), default=value, **extra,  # type: ignore[arg-type]
                            help=f"{help_text} (env {env}; default: {default})")


def from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed serve flags: each field is named after its flag."""
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
