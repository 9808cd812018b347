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


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=flags.absolute_path, default=DEFAULT_DIR,
                        help="host directory for the socket and the shim; the plugin's "
                             f"--broker-dir (default: {DEFAULT_DIR})")
    parser.add_argument("--state-dir", type=flags.absolute_path, default=DEFAULT_STATE,
                        help="host directory for the records of the mounts the broker "
                             f"made, on a tmpfs (default: {DEFAULT_STATE})")
    parser.add_argument("--shim", type=flags.absolute_path, default=DEFAULT_SHIM,
                        help=f"the built fusermount3 shim to install there; {HELPER_NAME} "
                             f"must be beside it (default: {DEFAULT_SHIM})")
    parser.add_argument("--lxcfs-dir", type=flags.absolute_path, default=DEFAULT_LXCFS_DIR,
                        help="host directory for the socket the node's lxcfs announces "
                             "itself on (LXCFS views); bound into the broker and lxcfs pods "
                             f"only, never into a tenant's (default: {DEFAULT_LXCFS_DIR})")
    parser.add_argument("--max-mounts", type=flags.count(1, 10_000), default=DEFAULT_MAX_MOUNTS,
                        help="FUSE mounts the broker makes for one container that the "
                             f"kernel may hold at once (default: {DEFAULT_MAX_MOUNTS})")
    parser.add_argument("--max-mounts-node", type=flags.count(1, 1_000_000), default=None,
                        help="the same for the whole node; below --max-mounts-pod x "
                             "--max-pods, pods at their share can fill it and refuse the "
                             "rest (default: that product, "
                             f"{DEFAULT_MAX_MOUNTS_POD * DEFAULT_MAX_PODS} at the defaults)")
    parser.add_argument("--max-mounts-pod", type=flags.count(1, 100_000),
                        default=DEFAULT_MAX_MOUNTS_POD,
                        help="the same for all the containers of one pod together, so that "
                             "no pod takes the node's share alone (default: "
                             f"{DEFAULT_MAX_MOUNTS_POD})")
    parser.add_argument("--max-pods", type=flags.count(1, 10_000), default=DEFAULT_MAX_PODS,
                        help="the most pods the node runs: the kubelet's maxPods. Every "
                             "node-wide cap is a pod's share times this, so that a pod "
                             "within its share is always served on a node of this many "
                             f"pods (default: {DEFAULT_MAX_PODS}, the kubelet's default)")
    parser.add_argument("--allow-other", type=flags.boolean, default=False,
                        help="let callers that are not root mount with allow_other, as "
                             "user_allow_other in /etc/fuse.conf does (default: false)")
    parser.add_argument("--metrics-port", type=flags.port, default=0,
                        help="serve /metrics, /healthz and /readyz on this TCP port; 0: "
                             "off (default: 0)")
    parser.add_argument("--metrics-address", type=flags.address, default="0.0.0.0",
                        help="address for --metrics-port (default: 0.0.0.0)")
    flags.add_log_flags(parser)
