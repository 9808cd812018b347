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
