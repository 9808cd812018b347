"""The slow stages, marked by folder; and shared fixtures: a fake node (device-plugin dir
+ a real char device 10:229 in a temp dir), the kubelet stand-in on a real unix socket,
and the real ``serve`` process. The code behind them lives in tests/lib/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lib.kubelet import KubeletStandIn
from tests.lib.node import HOST_FUSE, UDEV_MODE, FakeNode, host_fuse_mode
from tests.lib.plugin import PluginProcess, StartPlugin

# Each slow stage is a folder, with the per-test timeout its slowest test needs (the
# cluster stage builds and boots a control plane; a module can still ask for more).
STAGES = {"containers": None, "kubelet": 1800, "cluster": 3000, "apparmor_vm": 1800}


# The order stages run in: those that use scripts/warm-caches' builds (the stack, the
# images, helm) last, so on a fresh machine they are built in the background meanwhile.
ORDER = ("apparmor_vm", "unit", "containers", "kubelet", "cluster")


def stage_of(item: pytest.Item) -> str:
    try:
        return item.path.relative_to(Path(__file__).parent).parts[0]
    except ValueError:
        return ""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the stages in ORDER (each keeps its own order); mark every test of a stage
    folder ``slow``, and give it the stage's timeout."""
    items.sort(key=lambda item: ORDER.index(stage_of(item)) if stage_of(item) in ORDER
               else len(ORDER))
    for item in items:
        stage = stage_of(item)
        if stage not in STAGES:
            continue
        item.add_marker(pytest.mark.slow)
        timeout = STAGES[stage]
        if timeout is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout))


@pytest.fixture(scope="session")
def udev_fuse() -> Iterator[None]:
    """The README's node precondition for non-root and user-namespaced callers: the host's
    /dev/fuse at udev's 0666 for the rest of the session (a fresh machine's is 0600), put
    back at the end. Every stage whose callers need it asks for it."""
    if not HOST_FUSE.is_char_device() or os.geteuid() != 0:
        yield
        return
    with host_fuse_mode(UDEV_MODE):
        yield


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's FUSE device is made with mknod (CAP_MKNOD)")
    return FakeNode.create(tmp_path)


@pytest.fixture
def kubelet(node: FakeNode) -> Iterator[KubeletStandIn]:
    with KubeletStandIn(node.plugin_dir) as standin:
        yield standin


@pytest.fixture
def start_plugin(node: FakeNode) -> Iterator[StartPlugin]:
    started: list[PluginProcess] = []

    def start(*extra: str, slots: int = 8) -> PluginProcess:
        plugin = PluginProcess(node, *extra, slots=slots)
        started.append(plugin)
        return plugin

    yield start
    for plugin in started:
        plugin.close()
