"""A pretend node for the tests and the benchmarks: a device-plugin directory and
a real character device 10:229 in a directory of our own. The plugin only stat()s the
device node, so it behaves exactly as it does against /dev/fuse. Needs root (mknod)."""

from __future__ import annotations

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
