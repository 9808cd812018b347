"""Fair shares (fuse_plugin/broker/policy.pod_of, room_in_pod): which containers are one
pod, and a pod's share of the node's mounts."""

from __future__ import annotations

import pytest

from fuse_plugin.broker import policy

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


@pytest.mark.parametrize(("container", "pod"), [
    # the kubelet's cgroupfs driver: /kubepods[/class]/pod<uid>/<container>
    (f"/kubepods/burstable/pod{UID}/abc123", f"/kubepods/burstable/pod{UID}"),
    (f"/kubepods/pod{UID}/abc123", f"/kubepods/pod{UID}"),
    # the systemd driver: ...-pod<uid with underscores>.slice/cri-containerd-<id>.scope
    ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
     f"{UID.replace('-', '_')}.slice/cri-containerd-abc.scope",
     "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
     f"{UID.replace('-', '_')}.slice"),
    # not in a pod's cgroup: a pod of its own
    ("/fuse-e2e-attacker1-1234abcd", "/fuse-e2e-attacker1-1234abcd"),
    ("/system.slice/containerd.service", "/system.slice/containerd.service"),
    ("/", "/"),
])
def test_a_pod_is_its_containers_parent_cgroup_when_that_is_a_pods(container: str,
                                                                   pod: str) -> None:
    assert policy.pod_of(container) == pod


def test_a_pods_share_of_the_nodes_mounts() -> None:
    policy.room_in_pod(5, 6, "/kubepods/podx")
    with pytest.raises(policy.Refused, match=r"already holds 6 .*--max-mounts-pod 6"):
        policy.room_in_pod(6, 6, "/kubepods/podx")


SYSTEMD_POD = ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
               f"{UID.replace('-', '_')}.slice")
STATIC_POD = "/kubepods/besteffort/pod6f1c8a3d9e2b4a7c8d9e0f1a2b3c4d5e"  # a config hash


@pytest.mark.parametrize(("cgroup", "container"), [
    (f"/kubepods/burstable/pod{UID}/abc123", f"/kubepods/burstable/pod{UID}/abc123"),
    (f"{SYSTEMD_POD}/cri-containerd-abc.scope", f"{SYSTEMD_POD}/cri-containerd-abc.scope"),
    (f"{STATIC_POD}/abc", f"{STATIC_POD}/abc"),
    # cgroups a tenant made below its container's, with names of its choosing
    (f"/kubepods/pod{UID}/abc123/split0", f"/kubepods/pod{UID}/abc123"),
    (f"/kubepods/pod{UID}/abc123/pod{UID}/x/y", f"/kubepods/pod{UID}/abc123"),
    (f"{SYSTEMD_POD}/cri-containerd-abc.scope/a.slice/kubepods-pod1.slice/b",
     f"{SYSTEMD_POD}/cri-containerd-abc.scope"),
    # outside any pod: the cgroup's first component
    ("/fuse-e2e-attacker1-1234abcd", "/fuse-e2e-attacker1-1234abcd"),
    ("/fuse-e2e-attacker1-1234abcd/mine", "/fuse-e2e-attacker1-1234abcd"),
    ("/system.slice/containerd.service", "/system.slice"),
    ("/", "/"),
])
def test_a_container_is_the_cgroup_below_its_pods_whatever_the_tenant_makes(
        cgroup: str, container: str) -> None:
    assert policy.container_of(cgroup) == container
    assert policy.pod_of(policy.container_of(cgroup)) == policy.pod_of(container)
