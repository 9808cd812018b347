"""The real ``fuse-device-plugin serve`` process as the DaemonSet runs it, and its real
Allocate answer: the process registers with the kubelet stand-in, which then calls
Allocate over the plugin's socket, as the kubelet does when a pod asking for
github.com/fuse is admitted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuse_plugin.api import api_pb2 as api
from tests.lib.kubelet import KubeletStandIn
from tests.lib.node import FakeNode

RESOURCE = "github.com/fuse"


class PluginProcess:
    """The real ``fuse-device-plugin serve`` as the DaemonSet runs it."""

    def __init__(self, node: FakeNode, *extra: str, slots: int = 8) -> None:
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

    def events(self, name: str) -> list[dict[str, Any]]:
        """The logged events called ``name``, exactly, from a plugin started with
        ``--log-format json`` (text lines are for people, not for counting)."""
        found = []
        for line in self.log.splitlines():
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
        return found

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
