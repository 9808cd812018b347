"""Fixtures of the cluster stage. The cluster is one per module (bring-up ~30 s once the
binaries and images are cached), and down, its lock released, before pytest moves on to
another stage: tests/kubelet needs the same kubelet root. Everything a test needs on it is
made by a fixture that checks or restores its own state, so each test passes alone and in
any order."""

from __future__ import annotations

import contextlib
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import runtime
from tests.cluster import servers as servermod
from tests.cluster.cluster import LOGDIR, Api, Cluster, Kubectl, find_kubectl
from tests.cluster.kube import (
    APPLY,
    DEFAULT_SLOTS,
    EVIDENCE,
    INSTALLER_DS,
    PLUGIN_DS,
    PLUGIN_NS,
    PLUGIN_SELECTOR,
    SLOTS_ENV,
    daemonset_pod,
    evidence,
    manifests_overlay,
    plugin_env,
    rollout,
    wait_allocatable,
    wait_mounted,
)
from tests.cluster.sshfs_example import SSHFS_POD, apply_sshfs_example, delete_sshfs_example
from tests.cluster.vm_node import VmNode
from tests.cluster.worker import Worker
from tests.kubelet.node import skip_reason as node_skip_reason
from tests.kubelet.node import tail
from tests.lib import runtimes

HERE = Path(__file__).resolve().parent
# Cold on a fresh machine: packages, the kubernetes source, five Go binaries, the images.
SETUP_TIMEOUT = 2700


def first_line(*argv: str) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except OSError as exc:
        return f"? ({exc})"
    out = (r.stdout or r.stderr).strip()
    return out.splitlines()[0] if out else "?"


@pytest.fixture(scope="session")
def evidence_file() -> Path:
    """The stage's evidence file, emptied once per run: each module brings up its own
    cluster, and the second must not wipe the first one's lines."""
    with contextlib.suppress(OSError):  # not root: `cluster` skips the stage and says why
        LOGDIR.mkdir(parents=True, exist_ok=True)
        EVIDENCE.write_text("")
    return EVIDENCE


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, evidence_file: Path,
            udev_fuse: None) -> Iterator[Cluster]:
    """The module's cluster: one node, or as many as the module's CLUSTER_NODES says
    (the further ones tests/cluster/worker.py's), and the VM node (vm_node.py) where the
    module's VM_NODE says so."""
    reason = node_skip_reason("cluster stage")
    if reason:
        print(f"SKIPPED cluster stage: {reason}", file=sys.stderr)
        pytest.skip(reason)
    LOGDIR.mkdir(parents=True, exist_ok=True)
    setup_log = LOGDIR / "setup.log"
    # The lock first, then the set-up and its images: the cache is shared with other
    # worktrees, whose set-up may record their own images while this one waits.
    c = Cluster()
    t0 = time.monotonic()
    with open(setup_log, "w") as out:
        r = subprocess.run([str(HERE / "setup.sh"), "all"], stdout=out, stderr=subprocess.STDOUT,
                           timeout=SETUP_TIMEOUT, check=False)
    if r.returncode != 0:
        c.unlock()
    assert r.returncode == 0, f"setup.sh failed ({r.returncode}):\n{tail(setup_log, 60)}"
    setup_s = time.monotonic() - t0
    c.read_images()
    c.workers = [Worker(c, i) for i in range(2, getattr(request.module, "CLUSTER_NODES", 1) + 1)]
    if getattr(request.module, "VM_NODE", False):
        c.workers.append(VmNode(c))
    kubectl_path = find_kubectl()  # after setup.sh, which installs the fallback
    if isinstance(kubectl_path, str):
        c.unlock()
        pytest.skip(kubectl_path)
    bins = c.bins
    evidence(
        "versions",
        f"setup.sh took {setup_s:.0f}s",
        "etcd: " + first_line(str(bins / "etcd"), "--version"),
        "kube-apiserver: " + first_line(str(bins / "kube-apiserver"), "--version"),
        "kube-controller-manager: " + first_line(str(bins / "kube-controller-manager"),
                                                 "--version"),
        "kube-scheduler: " + first_line(str(bins / "kube-scheduler"), "--version"),
        "kubelet: " + first_line(str(bins / "kubelet"), "--version"),
        "containerd: " + first_line(str(bins / "containerd"), "--version"),
        *([f"the node's runtime: CRI-O ({runtimes.VARIABLE}=crio)",
           "crio: " + first_line(str(bins / "crio"), "--version"),
           "conmon: " + first_line(str(runtime.CONMON), "--version")]
          if runtimes.is_crio() else ["the node's runtime: containerd"]),
        "runc: " + first_line(str(bins / "runc"), "--version"),
        "podman: " + first_line("podman", "--version"),
        "CNI plugins: " + first_line(str(bins / "cni" / "bridge"), "--version"),
        f"kubectl: {kubectl_path[0]} (1.{kubectl_path[1]})",
        f"kernel: {platform.release()}",
    )
    t1 = time.monotonic()
    try:
        c.up()
        evidence("versions", f"cluster up in {time.monotonic() - t1:.0f}s")
        yield c
    finally:
        c.down()
        # Now, not when the Cluster is collected: a failed test's traceback keeps it (and
        # its lock) alive, and the next module's cluster would wait on this one for ever.
        c.unlock()


@pytest.fixture(scope="module")
def kubectl(cluster: Cluster) -> Kubectl:
    found = find_kubectl()
    assert not isinstance(found, str), found
    return Kubectl(found[0], cluster.admin_kubeconfig)


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Api:
    return cluster.api


@pytest.fixture(scope="module")
def images(cluster: Cluster) -> dict[str, str]:
    return {**cluster.images, **cluster.cluster_images}


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory, images: dict[str, str]) -> Path:
    return manifests_overlay(tmp_path_factory.mktemp("overlay"), images["PLUGIN_IMAGE"])


@pytest.fixture
def deployed(cluster: Cluster, kubectl: Kubectl, api: Api, overlay: Path) -> dict[str, Any]:
    """`kubectl apply -k` of the manifests (a no-op when they are there), the plugin at its
    default slot count, both DaemonSets rolled out; returns the plugin's Ready pod."""
    kubectl(*APPLY, "-k", str(overlay))
    if any(e["name"] == SLOTS_ENV for e in plugin_env(api)):
        kubectl("-n", PLUGIN_NS, "set", "env", f"daemonset/{PLUGIN_DS}", f"{SLOTS_ENV}-")
    rollout(kubectl, PLUGIN_DS)
    rollout(kubectl, INSTALLER_DS)
    wait_allocatable(api, DEFAULT_SLOTS)
    return daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR)


@pytest.fixture(scope="module")
def servers(cluster: Cluster, kubectl: Kubectl, api: Api, images: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> servermod.Servers:
    return servermod.start(kubectl, api, images["SERVERS_IMAGE"],
                           tmp_path_factory.mktemp("sshkeys"))


@pytest.fixture
def sshfs_pod(*, deployed: dict[str, Any], servers: servermod.Servers, kubectl: Kubectl,
              api: Api, images: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """manifests/examples/sshfs-pod.yaml, filled in, Running with its mount."""
    apply_sshfs_example(kubectl, servers, images, tmp_path)
    try:
        wait_mounted(kubectl, api, SSHFS_POD, "/mnt/remote", "fuse.sshfs")
        yield SSHFS_POD
    finally:
        delete_sshfs_example(kubectl, api)
