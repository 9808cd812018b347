"""Negative controls: take one part away from the recommended pod and the mount fails
with the message users will see. Each part is shown to be load-bearing, for each
workload; 'nothing' removed is the positive control of the same matrix."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, profiles, workloads
from tests.lib.workloads import Workload

DEVICE_NOT_FOUND = "fuse: device not found, try 'modprobe fuse' first"
OPEN_EPERM = "fuse: failed to open /dev/fuse: Operation not permitted"
# libfuse falls back to the fusermount helper when mount(2) says EPERM, and the helper's
# own mount(2) is refused the same way: this line is what users see.
MOUNT_EPERM = {"s3fs": "fusermount: mount failed: Operation not permitted",  # libfuse 2
               "sshfs": "fusermount3: mount failed: Operation not permitted"}  # libfuse 3
# lxcfs first makes private cgroup mounts of its own, so it fails before FUSE does.
LXCFS_EPERM = ("../src/bindings.c: 565: umount_if_mounted: Failed to unmount "
               "/run/lxcfs/controllers: Operation not permitted.",
               "Failed to setup private cgroup mounts for lxcfs")
PARTS = ("nothing", "device", "cgroup rule", "seccomp additions", "CAP_SYS_ADMIN")


def expected(name: str, part: str) -> tuple[str, ...]:
    """The exact lines the workload prints when ``part`` is missing."""
    if part == "device":
        return (DEVICE_NOT_FOUND,)
    if part == "cgroup rule":
        return (OPEN_EPERM,)
    return LXCFS_EPERM if name == "lxcfs" else (MOUNT_EPERM[name],)


@pytest.fixture
def workload(request: pytest.FixtureRequest, runc: oci.Runc) -> Callable[[str], Workload]:
    def make(name: str) -> Workload:
        data = runc.base / f"data-{name}"
        if name == "s3fs":
            return workloads.s3fs(request.getfixturevalue("moto"), data)
        if name == "sshfs":
            return workloads.sshfs(request.getfixturevalue("sshd"), data)
        return workloads.lxcfs()
    return make


def pod_without(part: str, work: Workload, allocation: api.ContainerAllocateResponse
                ) -> oci.Spec:
    overrides: dict[str, object] = {}
    if part == "device":
        allocation = api.ContainerAllocateResponse()  # what a pod without the resource gets
    if part == "seccomp additions":
        overrides["seccomp"] = profiles.without_additions(work.preset)
    if part == "CAP_SYS_ADMIN":
        overrides["add_capabilities"] = [c for c in profiles.capabilities(work.preset)
                                         if c != "CAP_SYS_ADMIN"]
    spec = oci.build_spec(workloads.container_request(work, allocation, **overrides))
    if part == "cgroup rule":
        spec = oci.remove_device_rule(spec, "/dev/fuse")
    return spec


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("name", ["s3fs", "sshfs", "lxcfs"])
def test_remove_one_part(name: str, part: str, allocation: api.ContainerAllocateResponse,
                         runc: oci.Runc, workload: Callable[[str], Workload]) -> None:
    work = workload(name)
    container = runc.create(pod_without(part, work, allocation), name).start()
    result = workloads.mount(container, work)
    print(f"\n[{name} without {part}] rc={result.returncode} output: {result.output.strip()}")
    if part == "nothing":
        assert result.returncode == 0, result.output
        assert (work.mountpoint, f"fuse.{name}") in container.mounts()
        container.exec(*work.unmount()).check()
        return
    assert result.returncode != 0
    lines = result.output.splitlines()
    for line in expected(name, part):
        assert line in lines, f"{line!r} not in the output:\n{result.output}"
    assert container.mounts() == []
