"""The broker's settings and their flags: where it serves, what it may hold."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import args as flags
from fuse_plugin.broker.helper import NAME as HELPER_NAME
from fuse_plugin.broker.lxcfs import DEFAULT_DIR as DEFAULT_LXCFS_DIR
from fuse_plugin.broker.shares import DEFAULT_MAX_PODS, NodeCaps

DEFAULT_DIR = Path("/var/lib/fuse-device-plugin/broker")
DEFAULT_STATE = Path("/run/fuse-device-plugin/broker")
DEFAULT_SHIM = Path("/usr/local/libexec/fuse-device-plugin/fusermount3")
DEFAULT_MAX_MOUNTS = 32
DEFAULT_MAX_MOUNTS_POD = 64  # a pod's share of the node's mounts (policy.pod_of)


@dataclass(frozen=True)
class BrokerSettings(flags.MetricsSettings):
    directory: Path = DEFAULT_DIR
    state: Path = DEFAULT_STATE
    shim: Path = DEFAULT_SHIM
    lxcfs_dir: Path = DEFAULT_LXCFS_DIR
    max_mounts: int = DEFAULT_MAX_MOUNTS
    max_mounts_node: int | None = None  # None: --max-mounts-pod x --max-pods
    max_mounts_pod: int = DEFAULT_MAX_MOUNTS_POD
    max_pods: int = DEFAULT_MAX_PODS
    allow_other: bool = False

    @property
    def caps(self) -> NodeCaps:
        """The node-wide caps: each a pod's share times --max-pods (``shares``)."""
        return NodeCaps.for_pods(self.max_pods, self.max_mounts_pod, self.max_mounts_node)


# flag, type, help: the broker's table (``args``); the defaults are BrokerSettings'.
FLAGS: tuple[flags.Flag, ...] = (
    ("--dir", flags.absolute_path,
     "host directory for the socket and the shim; the plugin's --broker-dir"),
    ("--state-dir", flags.absolute_path,
     "host directory for the records of the mounts the broker made, on a tmpfs"),
    ("--shim", flags.absolute_path,
     f"the built fusermount3 shim to install there; {HELPER_NAME} must be beside it"),
    ("--lxcfs-dir", flags.absolute_path,
     "host directory for the socket the node's lxcfs announces itself on (LXCFS views); "
     "bound into the broker and lxcfs pods only, never into a tenant's"),
    ("--max-mounts", flags.count(1, 10_000),
     "FUSE mounts the broker makes for one container that the kernel may hold at once"),
    ("--max-mounts-node", flags.count(1, 1_000_000),
     "the same for the whole node; below --max-mounts-pod x --max-pods, pods at their "
     "share can fill it and refuse the rest; None: that product "
     f"({DEFAULT_MAX_MOUNTS_POD * DEFAULT_MAX_PODS} at the defaults)"),
    ("--max-mounts-pod", flags.count(1, 100_000),
     "the same for all the containers of one pod together, so that no pod takes the "
     "node's share alone"),
    ("--max-pods", flags.count(1, 10_000),
     "the most pods the node runs: the kubelet's maxPods (its default is "
     f"{DEFAULT_MAX_PODS}). Every node-wide cap is a pod's share times this, so that a pod "
     "within its share is always served on a node of this many pods"),
    ("--allow-other", flags.boolean,
     "let callers that are not root mount with allow_other, as user_allow_other in "
     "/etc/fuse.conf does"),
    *flags.METRICS_FLAGS,
)
# The flags older than the fields they fill.
RENAMED = {"--dir": "directory", "--state-dir": "state"}


def add_flags(parser: argparse.ArgumentParser) -> None:
    flags.add_table(parser, FLAGS, BrokerSettings, renamed=RENAMED)


def from_args(parsed: argparse.Namespace) -> BrokerSettings:
    return flags.settings_of(BrokerSettings, parsed)
