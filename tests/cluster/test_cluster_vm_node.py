"""The node users run (issue 45): a VM node in the cluster (tests/cluster/vm_node.py) with
Debian's own Linux 6.12, AppArmor enforcing and cgroup v2 alone, beside the stage's first
node. What no other node of the stage can show: the profile installer loading the
generated AppArmor profiles into a real kernel, the kubelet passing `appArmorProfile:
Localhost` to containerd and runc confining the FUSE program with it, and the same pod
refused its mount under the runtime's default profile (the control).

The example pods are applied exactly as shipped (their `appArmorProfile` kept), their
placeholders filled in as their comments say; the first node is cordoned meanwhile, so
the scheduler places them on the VM node (a DaemonSet ignores the cordon).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster import servers as servermod
from tests.cluster.cluster import NODE_NAME, Api, Cluster, Kubectl
from tests.cluster.kube import (
    APPLY,
    BROKER_DS,
    EXAMPLES_NS,
    INSTALLER_DS,
    PLUGIN_DS,
    PLUGIN_NS,
    PLUGIN_SELECTOR,
    evidence,
    exec_in,
    manifests_overlay,
    one_ready_per_node,
    pod_summary,
    rollout,
    wait_mounted,
)
from tests.cluster.sshfs_example import SSHFS_POD, apply_sshfs_example, delete_sshfs_example
from tests.cluster.test_cluster_broker import (
    BASELINE,
    BROKER_SELECTOR,
    MOUNTPOINT,
    edit_add_component,
    fuse_line,
    lines_with,
    pod_log,
    round_trip,
    unmount,
)
from tests.cluster.vm_node import VmNode
from tests.kubelet.node import tail, wait_for

VM_NODE = True
VM = f"{NODE_NAME}-vm"
PROFILES = Path(__file__).resolve().parents[2] / "manifests" / "profiles-configmap.yaml"
SERVERS_NS = servermod.NAMESPACE


@pytest.fixture(scope="module")
def vm(cluster: Cluster) -> VmNode:
    [node] = [w for w in cluster.workers if isinstance(w, VmNode)]
    return node


@pytest.fixture(scope="module")
def on_vm(*, cluster: Cluster, kubectl: Kubectl, api: Api, overlay: Path, vm: VmNode,
          servers: servermod.Servers) -> Iterator[None]:
    """The manifests applied as the README says, both DaemonSets rolled out on both
    nodes, the test servers up (on the first node), and the first node cordoned: new
    pods go to the VM node."""
    kubectl(*APPLY, "-k", str(overlay))
    rollout(kubectl, PLUGIN_DS)
    rollout(kubectl, INSTALLER_DS)
    one_ready_per_node(api, PLUGIN_SELECTOR)
    kubectl("cordon", NODE_NAME)
    try:
        yield
    finally:
        kubectl("uncordon", NODE_NAME)


def generated_profiles() -> set[str]:
    """The AppArmor profiles the installer's ConfigMap carries (its keys not ending in
    .json), by name."""
    [doc] = [d for d in yaml.safe_load_all(PROFILES.read_text()) if d]
    return {key for key in doc["data"] if not key.endswith(".json")}


def test_the_vm_node_runs_the_kernel_users_run(cluster: Cluster, api: Api,
                                               vm: VmNode) -> None:
    node = api.node(VM)
    info = node["status"]["nodeInfo"]
    facts = vm.facts()
    kubelet = (vm.node_dir / "kubelet.log").read_text()
    version = re.findall(r'"CgroupVersion":\d+', kubelet)
    proof = evidence("vm-node", f"kernel {info['kernelVersion']}, {info['osImage']}, "
                     f"runtime {info['containerRuntimeVersion']}, kubelet "
                     f"{info['kubeletVersion']}", f"facts {facts}",
                     f"timings {vm.timings}", f"kubelet: {version[:1]}")
    assert info["kernelVersion"].startswith("6.12."), proof
    assert facts["cgroup"] == "cgroup2fs", proof
    assert facts["apparmor"] == "Y", proof
    assert version[:1] == ['"CgroupVersion":2'], proof


def test_the_installer_loads_the_generated_profiles_into_the_nodes_kernel(
        on_vm: None, vm: VmNode) -> None:
    wanted = generated_profiles()
    assert wanted, PROFILES
    loaded = wait_for(lambda: {n: m for n, m in vm.apparmor_profiles().items()
                               if n in wanted} if wanted <= set(vm.apparmor_profiles())
                      else None, 180, "the installer to load every generated profile",
                      interval=1, detail=lambda: "\n".join(sorted(vm.apparmor_profiles())))
    evidence("vm-node", *(f"aa: {n} ({m})" for n, m in sorted(loaded.items())))
    assert set(loaded.values()) == {"enforce"}, loaded


@pytest.fixture(scope="module")
def servers(cluster: Cluster, kubectl: Kubectl, api: Api, images: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> servermod.Servers:
    """The test servers, on the first node (before the cordon)."""
    return servermod.start(kubectl, api, images["SERVERS_IMAGE"],
                           tmp_path_factory.mktemp("sshkeys"))


def test_the_sshfs_example_as_shipped_mounts_under_its_apparmor_profile(
        *, servers: servermod.Servers, on_vm: None, kubectl: Kubectl, api: Api,
        images: dict[str, str], vm: VmNode, tmp_path: Path) -> None:
    apply_sshfs_example(kubectl, servers, images, tmp_path, apparmor=True)
    try:
        mount = wait_mounted(kubectl, api, SSHFS_POD, "/mnt/remote", "fuse.sshfs")
        pod = next(p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] == SSHFS_POD)
        token = uuid.uuid4().hex
        exec_in(kubectl, SERVERS_NS, "sshd", f"echo from-server-{token} > /srv/data/in.txt")
        read = exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, "cat /mnt/remote/in.txt")
        exec_in(kubectl, EXAMPLES_NS, SSHFS_POD,
                f"echo from-pod-{token} > /mnt/remote/out.txt")
        back = exec_in(kubectl, SERVERS_NS, "sshd", "cat /srv/data/out.txt")
        confined = exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, "cat /proc/self/attr/current")
        proof = evidence("vm-node", f"sshfs on {pod['spec'].get('nodeName')}: {mount}",
                         f"server -> pod: {read}", f"pod -> server: {back}",
                         f"AppArmor: {confined}")
        assert pod["spec"].get("nodeName") == VM, proof
        assert read == f"from-server-{token}", proof
        assert back == f"from-pod-{token}", proof
        assert confined == "fuse-device-plugin-sshfs (enforce)", proof
    finally:
        delete_sshfs_example(kubectl, api)


def test_under_the_runtimes_default_profile_the_same_pod_is_refused_its_mount(
        *, servers: servermod.Servers, on_vm: None, kubectl: Kubectl, api: Api,
        images: dict[str, str], vm: VmNode, tmp_path: Path) -> None:
    """The control: only `appArmorProfile` changed, to RuntimeDefault (containerd's
    cri-containerd.apparmor.d, which denies mount): sshfs is refused with EACCES."""
    name = "sshfs-control"
    apply_sshfs_example(kubectl, servers, images, tmp_path, name=name, apparmor=True,
                        container={"securityContext": {"appArmorProfile": {
                            "type": "RuntimeDefault", "localhostProfile": None}}})
    try:
        def said() -> str | None:
            pods = [p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] == name]
            if not pods or not pods[0].get("status", {}).get("containerStatuses"):
                return None
            r = kubectl.run("-n", EXAMPLES_NS, "logs", name, check=False)
            r_prev = kubectl.run("-n", EXAMPLES_NS, "logs", name, "--previous", check=False)
            text = r.stdout + r_prev.stdout
            return text if "Permission denied" in text else None

        logs: str = wait_for(said, 240, "the control pod's mount to be refused", interval=2,
                             detail=lambda: "\n".join(pod_summary(p) for p in
                                                      api.pods(EXAMPLES_NS)))
        pod = next(p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] == name)
        evidence("vm-node", f"control on {pod['spec'].get('nodeName')}: "
                 f"{logs.strip().splitlines()[-1]}", tail(vm.node_dir / "kubelet.log", 2))
        assert pod["spec"].get("nodeName") == VM
        assert "fuse: mount failed: Permission denied" in logs
    finally:
        delete_sshfs_example(kubectl, api, name)


def test_broker_mode_at_baseline_on_the_vm_node(
        *, servers: servermod.Servers, on_vm: None, kubectl: Kubectl, api: Api,
        images: dict[str, str], vm: VmNode, tmp_path: Path) -> None:
    """The broker component added as the README says, and its one-line example pod
    (`github.com/fuse: 1`, no capability, RuntimeDefault seccomp and the runtime's
    default AppArmor profile, which denies mount) at `baseline` on the VM node: libfuse's
    mount(2) meets seccomp's EPERM before AppArmor's EACCES, runs the shim, and the
    broker mounts; its helpers are charged in cgroup v2 (the broker says which
    hierarchies at start)."""
    overlay = manifests_overlay(tmp_path, images["PLUGIN_IMAGE"])
    edit_add_component(overlay, "broker")
    kubectl(*APPLY, "-k", str(overlay))
    for ds in (BROKER_DS, PLUGIN_DS, INSTALLER_DS):
        rollout(kubectl, ds)
    broker = one_ready_per_node(api, BROKER_SELECTOR)[VM]["metadata"]["name"]
    BASELINE.apply(kubectl, tmp_path, servers, images)
    try:
        mounted = wait_mounted(kubectl, api, BASELINE.name, MOUNTPOINT, "fuse.sshfs",
                               namespace=BASELINE.namespace)
        pod = next(p for p in api.pods(BASELINE.namespace)
                   if p["metadata"]["name"] == BASELINE.name)
        data = round_trip(kubectl, BASELINE, MOUNTPOINT, "vm")
        confined = BASELINE.sh(kubectl, "cat /proc/self/attr/current")
        line = fuse_line(kubectl, BASELINE, MOUNTPOINT)
        log = pod_log(kubectl, PLUGIN_NS, broker)
        serving = lines_with(log, " broker.serving ")
        mounts = lines_with(log, " broker.mount ", pod["metadata"]["uid"])
        gone = unmount(kubectl, BASELINE, MOUNTPOINT)
        proof = evidence("vm-node", f"broker example on {pod['spec'].get('nodeName')}: "
                         f"{mounted}", *data, f"AppArmor: {confined}", *serving[-1:],
                         *mounts, gone)
        assert pod["spec"].get("nodeName") == VM, proof
        assert confined.startswith("cri-containerd.apparmor.d"), proof
        assert "nosuid" in line.split()[5], proof
        assert serving, proof
        assert "unified" in serving[-1], proof
        assert len(mounts) == 1, proof
        assert "rc=0" in gone, proof
    finally:
        BASELINE.delete(kubectl, api)
