"""The user-namespace variant (``hostUsers: false``): the container's root is host uid
100000, CAP_SYS_ADMIN counts only inside its namespaces. runc then bind-mounts the
host's /dev/fuse instead of making a node, so the host node's mode decides: with 0600
(a node without udev) the open is refused; with 0666 (udev's default) sshfs and s3fs
mount and work; lxcfs does not get that far. The devices cgroup still applies. The
host node's mode is always restored."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, workloads
from tests.lib.node import HOST_FUSE, UDEV_MODE, host_fuse_mode
from tests.lib.servers import Moto, Sshd
from tests.lib.workloads import BUCKET

OPEN_EACCES = "fuse: failed to open /dev/fuse: Permission denied"
OPEN_EPERM = "fuse: failed to open /dev/fuse: Operation not permitted"


@pytest.fixture
def fuse_mode(machine: None) -> Iterator[Callable[[int], None]]:
    """Set the host /dev/fuse's mode for one test; the stage's mode is always put back."""
    with host_fuse_mode(UDEV_MODE):
        yield HOST_FUSE.chmod


def _workload(name: str, runc: oci.Runc, request: pytest.FixtureRequest
              ) -> workloads.Workload:
    data = runc.base / f"data-{name}"
    if name == "s3fs":
        return workloads.s3fs(request.getfixturevalue("moto"), data, oci.USERNS_HOST_ID)
    if name == "sshfs":
        return workloads.sshfs(request.getfixturevalue("sshd"), data, oci.USERNS_HOST_ID)
    return workloads.lxcfs()


def _userns_mount(allocation: api.ContainerAllocateResponse, runc: oci.Runc,
                  work: workloads.Workload, remove_rule: bool = False, **extra: object
                  ) -> tuple[oci.RuncContainer, oci.Result]:
    spec = oci.build_spec(workloads.container_request(work, allocation, host_users=False,
                                                      **extra))
    if remove_rule:
        spec = oci.remove_device_rule(spec, "/dev/fuse")
    container = runc.create(spec, f"userns-{work.name}").start()
    return container, workloads.mount(container, work)


def test_userns_root_is_not_host_root(allocation: api.ContainerAllocateResponse,
                                      runc: oci.Runc, request: pytest.FixtureRequest) -> None:
    work = _workload("sshfs", runc, request)
    spec = oci.build_spec(workloads.container_request(work, allocation, host_users=False))
    container = runc.create(spec, "ids").start()
    uid_map = container.exec("cat", "/proc/self/uid_map").check().stdout.split()
    assert uid_map == ["0", str(oci.USERNS_HOST_ID), str(oci.USERNS_SIZE)]
    assert Path(f"/proc/{container.pid}/status").read_text().count(
        f"\t{oci.USERNS_HOST_ID}\t") >= 1


def test_userns_fuse_with_a_0600_node_is_refused(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc,
        request: pytest.FixtureRequest, fuse_mode: Callable[[int], None]) -> None:
    fuse_mode(0o600)
    container, result = _userns_mount(allocation, runc, _workload("sshfs", runc, request))
    print(f"\n[sshfs, hostUsers: false, /dev/fuse 0600] rc={result.returncode}: "
          f"{result.output.strip()}")
    assert result.returncode != 0
    assert OPEN_EACCES in result.output.splitlines()
    assert container.mounts() == []


@pytest.mark.parametrize("name", ["sshfs", "s3fs"])
def test_userns_fuse_with_a_0666_node_mounts_and_works(
        name: str, allocation: api.ContainerAllocateResponse, runc: oci.Runc,
        request: pytest.FixtureRequest, fuse_mode: Callable[[int], None]) -> None:
    fuse_mode(0o666)
    work = _workload(name, runc, request)
    container, result = _userns_mount(allocation, runc, work)
    print(f"\n[{name}, hostUsers: false, /dev/fuse 0666] rc={result.returncode}: "
          f"{result.output.strip() or 'mounted'}")
    result.check()
    assert (work.mountpoint, f"fuse.{name}") in container.mounts()
    path = f"{work.mountpoint}/from-userns-{name}.txt"
    container.sh(f"echo written in a user namespace > {path}").check()
    assert container.exec("cat", path).check().stdout == "written in a user namespace\n"
    if name == "sshfs":
        server: Sshd = request.getfixturevalue("sshd")
        assert (server.export / f"from-userns-{name}.txt").read_text() == \
            "written in a user namespace\n"
    else:
        moto: Moto = request.getfixturevalue("moto")
        body = moto.client().get_object(Bucket=BUCKET, Key=f"from-userns-{name}.txt")
        assert body["Body"].read() == b"written in a user namespace\n"
    container.exec(*work.unmount()).check()
    assert container.mounts() == []


def test_userns_lxcfs_cannot_make_its_cgroup_mounts(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc,
        request: pytest.FixtureRequest, fuse_mode: Callable[[int], None]) -> None:
    """lxcfs mounts cgroup v1 hierarchies in a private namespace: a user namespace may
    not (measured here on cgroup v1; the FUSE part is never reached)."""
    fuse_mode(0o666)
    container, result = _userns_mount(allocation, runc, _workload("lxcfs", runc, request),
                                      memory_limit=256 << 20, cpuset="0")
    print(f"\n[lxcfs, hostUsers: false] rc={result.returncode}: "
          f"{result.output.strip().splitlines()[-1]}")
    assert result.returncode != 0
    assert "Failed to setup private cgroup mounts for lxcfs" in result.output.splitlines()
    assert container.mounts() == []


def test_userns_devices_cgroup_still_applies(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc,
        request: pytest.FixtureRequest, fuse_mode: Callable[[int], None]) -> None:
    fuse_mode(0o666)
    container, result = _userns_mount(allocation, runc, _workload("sshfs", runc, request),
                                      remove_rule=True)
    assert result.returncode != 0
    assert OPEN_EPERM in result.output.splitlines(), result.output
    assert container.mounts() == []
