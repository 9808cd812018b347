"""Settings for ``serve``: its flags (each with an environment twin, ``args``), validated
once.

Validation happens before anything touches the node so that a typo in a DaemonSet
manifest fails the container at once with one readable line (exit code 2) instead of
a plugin that half-starts and never registers.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import args, names, sockets
from fuse_plugin.errors import EXIT_USAGE, Failure

DEFAULT_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_RESOURCE_NAME = "github.com/fuse"
DEFAULT_FUSE_DEVICE = Path("/dev/fuse")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
# Why 1000: /dev/fuse is shared, so a slot is only a ticket. The kubelet never runs more
# pods than maxPods (110 by default, 250 on the largest managed-node presets), but each
# container that asks for the resource takes its own slot. 1000 covers the largest
# maxPods times a few FUSE containers per pod, at a ListAndWatch message and memory
# that stay small (bench/README.md, "Slots").
DEFAULT_SLOTS = 1000
MAX_SLOTS = 100_000
KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"



@dataclass(frozen=True)
class Settings(args.MetricsSettings):
    device_plugin_dir: Path = DEFAULT_DEVICE_PLUGIN_DIR
    resource_name: str = DEFAULT_RESOURCE_NAME
    fuse_device: Path = DEFAULT_FUSE_DEVICE
    slots: int = DEFAULT_SLOTS
    cdi: bool = False
    cdi_dir: Path = DEFAULT_CDI_DIR
    broker_dir: Path | None = None
    instance: str = ""
    handoff_wait: int = 0

    @property
    def socket_name(self) -> str:
        """Our endpoint's file name: derived from the resource so that two plugins never
        collide, and from ``instance`` so that two pods of one DaemonSet do not either.
        The kubelet keeps one endpoint per socket path: only on a path of its own can a
        new pod register while the old one still serves (docs/operability.md#upgrades)."""
        base = socket_base(self.resource_name)
        return f"{base}-{self.instance}.sock" if self.instance else f"{base}.sock"

    @property
    def socket_path(self) -> Path:
        return self.device_plugin_dir / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET


def socket_base(resource: str) -> str:
    """What every socket name of ``resource``'s plugins starts with."""
    return resource.replace("/", "_")


def sibling_socket(resource: str) -> re.Pattern[str]:
    """The socket names a plugin for ``resource`` may have, with or without an instance.
    Another resource's name can match too (``github.com/fuse-x`` looks like an instance
    ``x`` of ``github.com/fuse``): whoever finds one asks it which resource it serves."""
    return re.compile(rf"{re.escape(socket_base(resource))}(-{names.QUALIFIED})?\.sock")


def instance(text: str) -> str:
    """An instance name for the socket: empty (none), or what a pod's UID or name is,
    1-63 characters of [A-Za-z0-9-_.]. A slash or a space would make no socket name."""
    if text and not names.qualified_name(text):
        raise argparse.ArgumentTypeError(
            f"must be empty or 1-63 characters of [A-Za-z0-9-_.], starting and ending "
            f"alphanumeric (a pod UID or name), got {args.shown(text)}")
    return text


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
    if not names.dns_subdomain(domain, names.SUBDOMAIN_MAX - len("requests.")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: domain {domain!r} is not a lowercase DNS subdomain of at most "
            "244 characters")
    if not names.qualified_name(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: name {name!r} must be 1-63 characters of [A-Za-z0-9-_.], "
            "starting and ending alphanumeric")
    return text


slots = args.count(1, MAX_SLOTS)
# The DaemonSet's terminationGracePeriodSeconds caps any wait longer than this anyway.
MAX_HANDOFF_WAIT = 300
handoff_wait = args.count(0, MAX_HANDOFF_WAIT)


def plugin_dir(text: str) -> Path:
    """An absolute path gRPC can dial: its ``unix:`` targets split addresses at commas."""
    path = args.absolute_path(text)
    if "," in text:
        raise argparse.ArgumentTypeError(
            f"must not contain a comma (gRPC reads it as a list of addresses), got {text!r}")
    return path


# flag, type, help: the one table the CLI and the env twins are built from; each flag
# is named after its Settings field, which holds the default.
SERVE_FLAGS: tuple[args.Flag, ...] = (
    ("--device-plugin-dir", plugin_dir,
     "the kubelet's device-plugin directory (holds kubelet.sock)"),
    ("--resource-name", resource_name, "extended resource to advertise"),
    ("--fuse-device", args.absolute_path,
     "host FUSE device node handed to containers (must be char 10:229)"),
    ("--slots", slots, "how many containers may hold the shared device at once"),
    *args.METRICS_FLAGS,
    ("--cdi", args.boolean,
     "also write a CDI spec and answer Allocate with its device name (Kubernetes 1.28+)"),
    ("--cdi-dir", args.absolute_path, "where the CDI spec is written"),
    ("--broker-dir", args.optional_path,
     "broker mode: the broker's host directory, bound with its fusermount3 shim into "
     "every container (docs/broker.md); empty: off"),
    ("--instance", instance,
     "a name of this plugin instance (the DaemonSet passes the pod UID): the socket becomes "
     "<resource>-<instance>.sock, so that a new pod registers before the old one stops; "
     "empty: <resource>.sock"),
    ("--handoff-wait", handoff_wait,
     "seconds to keep serving after SIGTERM until another instance for the resource has "
     "registered with the kubelet (needs --instance); 0: stop at once"),
)


def add_serve_flags(parser: argparse.ArgumentParser,
                    only: Collection[str] | None = None) -> None:
    """Add the serve flags (or ``only`` those), each with its environment twin."""
    args.add_table(parser, SERVE_FLAGS, Settings, only)


def from_args(parsed: argparse.Namespace) -> Settings:
    """Settings from parsed serve flags (each field is named after its flag), with the
    checks that need two of them; raises ``Failure`` (exit 2)."""
    settings = args.settings_of(Settings, parsed)
    too_long = sockets.too_long(settings.socket_path)
    if too_long:
        raise Failure(f"the plugin's socket {too_long}: use a shorter --device-plugin-dir, "
                      "--resource-name or --instance", EXIT_USAGE)
    if settings.handoff_wait and not settings.instance:
        raise Failure("--handoff-wait needs --instance: a successor can only register "
                      "beside this plugin on a socket of its own", EXIT_USAGE)
    return settings
