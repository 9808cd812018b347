"""The plugin's real Allocate answer: the real ``fuse-device-plugin serve`` process
registers with the kubelet stand-in, which then calls Allocate over the plugin's socket,
as the kubelet does when a pod asking for github.com/fuse is admitted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.sim.kubelet import KubeletStandIn
from tests.containers.servers import stop_process

RESOURCE = "github.com/fuse"


def allocate(directory: Path, fuse_device: Path = Path("/dev/fuse"), slots: int = 4,
             device_ids: tuple[str, ...] = ("fuse-0",), extra: tuple[str, ...] = ()
             ) -> api.ContainerAllocateResponse:
    """Start the standin and the plugin in ``directory``, allocate one container, stop
    both; returns the plugin's ContainerAllocateResponse for that container."""
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / "plugin.log").open("wb")
    standin = KubeletStandIn(directory).start()
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fuse_plugin", "serve", "--device-plugin-dir",
             str(directory), "--fuse-device", str(fuse_device), "--slots", str(slots),
             *extra],
            stdout=log, stderr=subprocess.STDOUT)
        standin.wait_registered(timeout=15)
        standin.wait_for(lambda: len(standin.devices(RESOURCE)) == slots, 10)
        response = standin.allocate(RESOURCE, [list(device_ids)])
        return response.container_responses[0]
    except Exception as err:
        raise AssertionError(f"plugin allocate failed: {err}\nplugin log:\n"
                             f"{(directory / 'plugin.log').read_text()}") from err
    finally:
        stop_process(proc)
        standin.close()
        log.close()
