"""What a container is given for ``github.com/fuse``, decided in one place.

However it is asked for (the device plugin's Allocate, a DRA claim), a container gets the
node's FUSE device at /dev/fuse and, in broker mode, read-only binds of the broker's
directory (its socket) and of the fusermount3 shim at every place a FUSE library looks
for fusermount. With CDI on, Allocate also names the node's CDI device, so a runtime with
CDI may edit the container from the spec instead; the DeviceSpec stays for runtimes
without it. ``servicer`` answers the kubelet from a ``Grant``; ``dra.prepare`` writes the
same device and binds into a claim's CDI spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker.protocol import CONTAINER_DIR, SHIM_NAME, SHIM_TARGETS

CONTAINER_DEVICE = "/dev/fuse"


def broker_binds(broker_dir: Path) -> list[tuple[str, str]]:
    """(container path, host path) of every read-only bind broker mode adds: the socket's
    directory (a directory, so a restarted broker's new socket is seen) and the shim."""
    shim = str(broker_dir / SHIM_NAME)
    return [(CONTAINER_DIR, str(broker_dir)), *((target, shim) for target in SHIM_TARGETS)]


@dataclass(frozen=True)
class Grant:
    """What every container allocated the resource gets."""

    device: Path  # the FUSE node on the host
    cdi_device: str | None = None  # e.g. "github.com/fuse=fuse", with --cdi
    broker_dir: Path | None = None  # broker mode

    @property
    def binds(self) -> list[tuple[str, str]]:
        return broker_binds(self.broker_dir) if self.broker_dir is not None else []

    def response(self) -> api.ContainerAllocateResponse:
        """The kubelet's answer for one container."""
        return api.ContainerAllocateResponse(
            devices=[api.DeviceSpec(container_path=CONTAINER_DEVICE,
                                    host_path=str(self.device), permissions="rw")],
            cdi_devices=[api.CDIDevice(name=self.cdi_device)] if self.cdi_device else [],
            mounts=[api.Mount(container_path=inside, host_path=host, read_only=True)
                    for inside, host in self.binds])
