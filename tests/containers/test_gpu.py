"""The GPU point: a pod that gets /dev/fuse from the plugin does not get the node's other
devices. Fake GPU nodes (char 195:0, 195:1, 195:255 as nvidia0, nvidia1, nvidiactl) sit
in a fake host /dev. A privileged-style container (every host device, devices cgroup
``a *:* rwm``) sees them and its opens reach the kernel's driver lookup; ours sees only
/dev/fuse, and the devices cgroup refuses the GPU nodes even when one is made with
mknod or reached through a hostPath volume of the host's /dev."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, profiles

GPUS = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255)}
# Opens every path given and prints "<path> OK" or "<path> <ERRNO> <message>".
OPEN = ("import errno, os, sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_RDWR)); print(p, 'OK')\n"
        "    except OSError as e:\n"
        "        print(p, errno.errorcode[e.errno], e.strerror)\n")


@pytest.fixture
def host_dev(runc: oci.Runc) -> Path:
    dev = runc.base / "host-dev"
    dev.mkdir()
    for name, (major, minor) in GPUS.items():
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    os.mknod(dev / "fuse", 0o666 | stat.S_IFCHR, os.makedev(10, 229))
    return dev


def opens(container: oci.RuncContainer, *paths: str) -> dict[str, str]:
    out = container.exec("python3", "-c", OPEN, *paths).check().stdout
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()}


def ours(allocation: api.ContainerAllocateResponse, **extra: object) -> oci.ContainerRequest:
    return oci.ContainerRequest(
        args=["sleep", "infinity"], allocation=allocation,
        add_capabilities=profiles.capabilities("generic"),
        seccomp=profiles.seccomp("generic"), **extra)  # type: ignore[arg-type]


def test_privileged_style_container_gets_every_gpu(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc, host_dev: Path) -> None:
    spec = oci.build_spec(oci.ContainerRequest(
        args=["sleep", "infinity"], allocation=allocation, privileged=True, host_dev=host_dev))
    assert spec["linux"]["resources"]["devices"] == [{"allow": True, "access": "rwm"}]
    container = runc.create(spec, "privileged").start()
    listed = set(container.exec("ls", "/dev").check().stdout.split())
    assert {"nvidia0", "nvidia1", "nvidiactl", "fuse"} <= listed
    # The devices cgroup lets every open through: ENXIO is the kernel saying no driver
    # has major 195 on this GPU-less VM (with the driver loaded, the open succeeds).
    results = opens(container, *(f"/dev/{n}" for n in GPUS), "/dev/fuse")
    assert results == {**{f"/dev/{n}": "ENXIO No such device or address" for n in GPUS},
                       "/dev/fuse": "OK"}


def test_our_container_sees_only_fuse_and_cannot_reach_a_gpu(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc, host_dev: Path) -> None:
    request = ours(allocation, binds=[oci.Bind(host_dev, "/host-dev")])
    container = runc.create(oci.build_spec(request), "ours").start()
    listed = set(container.exec("ls", "/dev").check().stdout.split())
    assert "fuse" in listed
    assert not listed & set(GPUS)

    # runc appends "c *:* m" to every container's rules: the nodes can be made...
    for name, (major, minor) in GPUS.items():
        container.exec("mknod", f"/dev/{name}", "c", str(major), str(minor)).check()
    assert set(GPUS) <= set(container.exec("ls", "/dev").check().stdout.split())
    # ...but not opened; nor can they through a hostPath volume of the host's /dev.
    paths = [f"/dev/{n}" for n in GPUS] + [f"/host-dev/{n}" for n in GPUS]
    results = opens(container, "/dev/fuse", *paths)
    assert results == {"/dev/fuse": "OK",
                       **dict.fromkeys(paths, "EPERM Operation not permitted")}
    # The refusal is the devices cgroup's, the only rule-based check on a root process
    # that has CAP_MKNOD and CAP_DAC_OVERRIDE: the cgroup's list has no 195 entry.
    allowed = Path(f"/sys/fs/cgroup/devices/{container.id}/devices.list")
    if allowed.exists():
        rules = allowed.read_text().split("\n")
        assert "c 10:229 rw" in rules
        assert not [r for r in rules if r.startswith(("c 195:", "a "))]
