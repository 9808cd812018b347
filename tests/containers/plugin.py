"""The plugin's real Allocate answer: the real ``fuse-device-plugin serve`` process
registers with the kubelet stand-in, which then calls Allocate over the plugin's socket,
as the kubelet does when a pod asking for github.com/fuse is admitted."""

from __future__ import annotations

from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.sim.kubelet import KubeletStandIn
from fuse_plugin.sim.node import FakeNode
from tests.conftest import PluginProcess

RESOURCE = "github.com/fuse"


def allocate(directory: Path, fuse_device: Path = Path("/dev/fuse"), slots: int = 4,
             device_ids: tuple[str, ...] = ("fuse-0",), extra: tuple[str, ...] = ()
             ) -> api.ContainerAllocateResponse:
    """Start the stand-in and the real ``serve`` process in ``directory``, allocate one
    container, stop both; returns the plugin's ContainerAllocateResponse for it."""
    directory.mkdir(parents=True, exist_ok=True)
    node = FakeNode(root=directory, plugin_dir=directory, device=fuse_device)
    with KubeletStandIn(directory) as standin:
        plugin = PluginProcess(node, *extra, slots=slots)
        try:
            standin.wait_registered(timeout=15)
            standin.wait_for(lambda: len(standin.devices(RESOURCE)) == slots, 10)
            response = standin.allocate(RESOURCE, [list(device_ids)])
            return response.container_responses[0]
        except Exception as err:
            raise AssertionError(f"plugin allocate failed: {err}\nplugin log:\n"
                                 f"{plugin.log}") from err
        finally:
            plugin.terminate()
            plugin.close()
