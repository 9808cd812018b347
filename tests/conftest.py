"""Shared fixtures: a fake node (device-plugin dir + a real char device 10:229 in a temp
dir), the kubelet stand-in on a real unix socket, and the real ``serve`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fuse_plugin.sim.kubelet import KubeletStandIn
from fuse_plugin.sim.node import FakeNode, make_node

RESOURCE = "github.com/fuse"


def make_fuse_node(path: Path, major: int = 10, minor: int = 229) -> None:
    make_node(path, major, minor)


Node = FakeNode


@pytest.fixture
def node(tmp_path: Path) -> Node:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's FUSE device is made with mknod (CAP_MKNOD)")
    return FakeNode.create(tmp_path)


@pytest.fixture
def kubelet(node: Node) -> Iterator[KubeletStandIn]:
    with KubeletStandIn(node.plugin_dir) as standin:
        yield standin


class PluginProcess:
    """The real ``fuse-device-plugin serve`` as the DaemonSet runs it."""

    def __init__(self, node: Node, *extra: str, slots: int = 8) -> None:
        self.log_path = node.root / f"plugin-{os.getpid()}-{id(self)}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fuse_plugin", "serve",
             "--device-plugin-dir", str(node.plugin_dir), "--fuse-device", str(node.device),
             "--slots", str(slots), *extra],
            stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._log.close()


StartPlugin = Callable[..., PluginProcess]


@pytest.fixture
def start_plugin(node: Node) -> Iterator[StartPlugin]:
    started: list[PluginProcess] = []

    def start(*extra: str, slots: int = 8) -> PluginProcess:
        plugin = PluginProcess(node, *extra, slots=slots)
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.close()
