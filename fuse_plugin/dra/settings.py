"""Settings for ``dra``: its flags (each with an environment twin), validated once before
anything touches the node, as ``serve``'s are.

The driver name is ``fuse-device-plugin.github.com``: a DRA driver name must be a
lowercase DNS subdomain of at most 63 characters, and it should end in a domain of the
driver's vendor. This project already keys its labels under
``fuse-device-plugin.github.com/`` (the NetworkPolicy's metrics-reader label), so the
driver reuses that one name rather than inventing a second domain; ``github.com/fuse``
itself is a resource name, not a valid driver name (it holds a slash).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import args, names, sockets
from fuse_plugin.config import DEFAULT_CDI_DIR, DEFAULT_FUSE_DEVICE
from fuse_plugin.errors import EXIT_USAGE, Failure

DRIVER_NAME = "fuse-device-plugin.github.com"
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_BROKER_DIR = Path("/var/lib/fuse-device-plugin/broker")
# How many claims may hold the node's device at once: as many as the device plugin's
# default slots, for the same reason (config.DEFAULT_SLOTS).
DEFAULT_SLOTS = 1000
MAX_SLOTS = 100_000
SHARING = ("auto", "shared", "counted")
# A backstop: the slice's watch brings changes within a second.
DEFAULT_RESYNC = 300

DRIVER_NAME_MAX = 63


@dataclass(frozen=True)
class DraSettings(args.DaemonSettings):
    node_name: str = ""
    driver_name: str = DRIVER_NAME
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    cdi_dir: Path = DEFAULT_CDI_DIR
    fuse_device: Path = DEFAULT_FUSE_DEVICE
    broker_dir: Path = DEFAULT_BROKER_DIR
    slots: int = DEFAULT_SLOTS
    sharing: str = "auto"
    resync_seconds: int = DEFAULT_RESYNC
    publish: bool = True
    instance: str = ""
    probe_port: int = 0
    probe_address: str = "0.0.0.0"

    @property
    def service_socket(self) -> Path:
        """The DRA service's socket: the directory the kubelet's docs give drivers, named
        per instance so that two pods of a rolling update each have their own."""
        name = f"dra-{self.instance}.sock" if self.instance else "dra.sock"
        return self.plugins_dir / self.driver_name / name

    @property
    def registration_socket(self) -> Path:
        """Where the kubelet's plugin watcher finds us (it scans this directory). The
        kubelet (1.33+) keeps two registrations of one driver under distinct socket names
        and uses the newer, so a new pod serves before the old one stops."""
        tag = f"-{self.instance}" if self.instance else ""
        return self.registry_dir / f"{self.driver_name}{tag}-reg.sock"


def driver_name(text: str) -> str:
    if not names.dns_subdomain(text, DRIVER_NAME_MAX):
        raise argparse.ArgumentTypeError(
            f"{args.shown(text)} is not a DRA driver name: a lowercase DNS subdomain of at "
            f"most {DRIVER_NAME_MAX} characters, e.g. {DRIVER_NAME}")
    return text


def node_name(text: str) -> str:
    """A node name, or empty (the default, refused in ``from_args`` with its own line)."""
    if text and not names.dns_subdomain(text):
        raise argparse.ArgumentTypeError(
            f"{args.shown(text)} is not a node name (a lowercase DNS subdomain); the "
            "DaemonSet sets it from spec.nodeName")
    return text


def instance(text: str) -> str:
    """A pod's name (a DNS label), or empty."""
    if text and not names.dns_label(text):
        raise argparse.ArgumentTypeError(
            f"{args.shown(text)} is not an instance name (a lowercase DNS label of at most "
            "63 characters); the DaemonSet sets it from metadata.name")
    return text


FLAGS: tuple[args.Flag, ...] = (
    ("--node-name", node_name,
     "this node's name (required; the DaemonSet passes spec.nodeName through the env twin)"),
    ("--driver-name", driver_name, "the DRA driver name (ResourceSlice spec.driver)"),
    ("--plugins-dir", args.absolute_path,
     "the kubelet's plugins directory: the service socket is DIR/<driver>/dra.sock"),
    ("--registry-dir", args.absolute_path,
     "the kubelet's plugin registration directory (plugins_registry)"),
    ("--cdi-dir", args.absolute_path, "where the per-claim CDI specs are written"),
    ("--fuse-device", args.absolute_path,
     "host FUSE device node handed to containers (must be char 10:229)"),
    ("--broker-dir", args.absolute_path,
     "the broker's host directory, bound with its shim into broker-mode claims' containers"),
    ("--slots", args.count(1, MAX_SLOTS), "how many claims may hold the device at once"),
    ("--sharing", args.choice(SHARING),
     "auto: one shared device (allowMultipleAllocations), counted devices if the API "
     "server drops that field; shared or counted: only that"),
    ("--resync-seconds", args.count(1, 3600),
     "how often the ResourceSlice is checked against the API server besides its watch"),
    ("--publish", args.boolean, "publish the ResourceSlice (false: only serve the kubelet)"),
    ("--instance", instance,
     "this pod's name (the DaemonSet passes metadata.name): the sockets are named with it, "
     "so a new pod registers beside the old one in a rolling update; empty: one fixed name"),
    ("--probe-port", args.port,
     "serve /healthz, /readyz and /metrics on this port; 0 turns it off"),
    ("--probe-address", args.address, "address the probe port binds to"),
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    args.add_table(parser, FLAGS, DraSettings)


def from_args(parsed: argparse.Namespace) -> DraSettings:
    """Settings from parsed flags, with the checks that need more than one; raises
    ``Failure`` (exit 2)."""
    settings = args.settings_of(DraSettings, parsed)
    if not settings.node_name:
        raise Failure("--node-name is required (or FUSE_DEVICE_PLUGIN_NODE_NAME; the "
                      "DaemonSet sets it from spec.nodeName)", EXIT_USAGE)
    for flag, path in (("--plugins-dir", settings.service_socket),
                       ("--registry-dir", settings.registration_socket)):
        too_long = sockets.too_long(path)
        if too_long:
            raise Failure(f"the socket {too_long}: use a shorter {flag}", EXIT_USAGE)
    return settings
