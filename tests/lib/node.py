"""A pretend node for the tests and the benchmarks: a device-plugin directory and
a real character device 10:229 in a directory of our own. The plugin only stat()s the
device node, so it behaves exactly as it does against /dev/fuse. Needs root (mknod).

And the one node precondition the real-container stages set on the host itself: the
mode of the machine's /dev/fuse (``host_fuse_mode``)."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin.demo import make_node


@dataclass
class FakeNode:
    """A node's device-plugin directory and a real char 10:229 node, in ``root``.

    Used by the tests and the benchmarks: the plugin under test runs against it exactly
    as against /var/lib/kubelet/device-plugins and /dev/fuse. Needs root (mknod).
    """

    root: Path
    plugin_dir: Path
    device: Path

    @classmethod
    def create(cls, root: Path) -> FakeNode:
        node = cls(root, root / "device-plugins", root / "dev" / "fuse")
        node.plugin_dir.mkdir(parents=True, exist_ok=True)
        node.device.parent.mkdir(parents=True, exist_ok=True)
        node.restore_device()
        return node

    def remove_device(self) -> None:
        self.device.unlink()

    def restore_device(self) -> None:
        make_node(self.device)


HOST_FUSE = Path("/dev/fuse")
# What udev's rule KERNEL=="fuse", MODE="0666" (most distributions' default) gives a node,
# and what the README requires for non-root and user-namespaced callers. The kernel itself
# creates the node 0600: a machine without that rule (a fresh VM of ours) has 0600.
UDEV_MODE = 0o666


@contextmanager
def host_fuse_mode(mode: int) -> Iterator[None]:
    """The machine's /dev/fuse at ``mode`` for the block, its own mode put back after.

    A stage sets up the node it relies on rather than trusting what someone once did to
    the machine: the non-root callers of the container, kubelet and cluster stages need
    the udev mode; the tests of the documented error ask for 0600 inside it.
    """
    original = stat.S_IMODE(HOST_FUSE.stat().st_mode)
    HOST_FUSE.chmod(mode)
    try:
        yield
    finally:
        HOST_FUSE.chmod(original)
