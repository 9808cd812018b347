"""The Helm chart on a two-node cluster, as docs/operability.md ("Install, upgrade and
uninstall with Helm") tells a user: `helm install` of the previous version's chart
(tests/cluster/charts/, as `helm package` made it) with its own image (built by its own
Dockerfile from its source as released, beside the chart) in the default mode and a FUSE pod
(manifests/examples/sshfs-pod.yaml) reading its sshfs mount every 200 ms; `helm upgrade`
to this version with a FUSE pod created every second (none may be rejected); `helm upgrade
--reset-then-reuse-values --set mode=broker` with the pod still reading and a FUSE pod
created every second throughout (none may be rejected; each DaemonSet rolls node by
node), and a capability-less pod mounting through the broker; `helm rollback` to
revision 1 (the previous version, default mode), the pod still reading; `helm
uninstall`, after which nothing of ours is left in the API: no object the release
rendered, none labelled part-of fuse-device-plugin, no release record, and the node
serves no `github.com/fuse`. A
cluster of its own: nothing is deployed with kustomize here.

helm is scripts/build-helm's (v4.3.1 from the Go module proxy, cached)."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fuse_plugin import __version__
from tests.cluster.cluster import Api, Cluster, Kubectl
from tests.cluster.kube import (
    APPLY,
    BROKER_DS,
    DEFAULT_SLOTS,
    EXAMPLES_NS,
    INSTALLER_DS,
    LXCFS_DS,
    PLUGIN_DS,
    PLUGIN_NS,
    REPO,
    PodEverySecond,
    evidence,
    exec_in,
    fuse_resources,
    plugin_env,
    rollout,
    wait_allocatable,
    wait_mounted,
)
from tests.cluster.servers import NAMESPACE as SERVERS_NS
from tests.cluster.servers import Servers
from tests.cluster.sshfs_example import SSHFS_POD, apply_sshfs_example, delete_sshfs_example
from tests.cluster.test_cluster_broker import BASELINE, wait_example_mounted
from tests.kubelet.node import wait_for

# Two nodes, as an upgrade meets them: each DaemonSet rolls node by node.
CLUSTER_NODES = 2
CHART = REPO / "charts" / "fuse-device-plugin"
# The previous release's chart as `helm package` made it (0.1.0, from the commit that
# released it): what a user upgrades from.
PREVIOUS = REPO / "tests" / "cluster" / "charts" / "fuse-device-plugin-0.1.0.tgz"
BUILD_HELM = REPO / "scripts" / "build-helm"
RELEASE = "fuse-device-plugin"
# Where Helm keeps its record of the release (the objects go to namespace.name).
RELEASE_NS = "default"
BROKER_ENV = "FUSE_DEVICE_PLUGIN_BROKER_DIR"
# Where a FUSE pod is created every second through the upgrade from the previous
# version, and through the upgrade to broker mode.
VERSION_NS = "fdp-e2e-helm-version"
STREAM_NS = "fdp-e2e-helm-stream"
# The reader counts in /dev/shm, a tmpfs writable whatever the root filesystem (the
# example's is readOnlyRootFilesystem).
READER = ("nohup setsid sh -c 'while :; do if cat /mnt/remote/helm.txt >/dev/null; "
          "then echo ok; else echo FAIL; fi >> /dev/shm/reads; sleep 0.2; done' "
          ">/dev/null 2>&1 &")
# Every kind the chart renders in any mode, for the look after uninstall.
KINDS = ("namespaces,daemonsets,configmaps,networkpolicies,serviceaccounts,clusterroles,"
         "clusterrolebindings,deviceclasses,validatingadmissionpolicies,"
         "validatingadmissionpolicybindings")


@pytest.fixture(scope="module")
def helm_bin() -> str:
    try:
        built = subprocess.run([str(BUILD_HELM)], capture_output=True, text=True,
                               timeout=2400, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/build-helm did not finish in 40 minutes")
    if built.returncode != 0:
        pytest.skip("scripts/build-helm could not build helm: "
                    + " | ".join(built.stderr.strip().splitlines()[-3:]))
    return built.stdout.strip().splitlines()[-1]


class Helm:
    """The user's helm, with the cluster's admin kubeconfig."""

    def __init__(self, binary: str, kubeconfig: Path) -> None:
        self.binary, self.kubeconfig = binary, kubeconfig

    def __call__(self, *args: str, timeout: float = 300) -> str:
        r = subprocess.run([self.binary, f"--kubeconfig={self.kubeconfig}",
                            f"--namespace={RELEASE_NS}", *args],
                           capture_output=True, text=True, timeout=timeout, check=False)
        if r.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({r.returncode}):\n"
                                 f"{r.stderr.strip()}\n{r.stdout.strip()}")
        return r.stdout


@pytest.fixture(scope="module")
def helm(cluster: Cluster, helm_bin: str) -> Helm:
    return Helm(helm_bin, cluster.admin_kubeconfig)


def image_values(images: dict[str, str], which: str = "PLUGIN_IMAGE") -> list[str]:
    """The README's `--set image.repository=REGISTRY/fuse-device-plugin`, here with the
    tag the cluster's image has (a string: a tag of digits and an `e` is a number to
    --set, and the schema wants a string). ``PREVIOUS_PLUGIN_IMAGE``: the previous
    release's image, built from its source as released (tests/cluster/images.sh)."""
    name, _, tag = images[which].rpartition(":")
    return [f"--set=image.repository={name}", f"--set-string=image.tag={tag}"]


def reads(kubectl: Kubectl) -> tuple[int, int]:
    """The reader's (good, failed) reads so far."""
    out = exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, "cat /dev/shm/reads").split()
    return out.count("ok"), out.count("FAIL")


def more_reads(kubectl: Kubectl, since: tuple[int, int]) -> tuple[int, int]:
    """Wait until the reader has read again after ``since``; returns its counts."""
    def seen() -> tuple[int, int] | None:
        now = reads(kubectl)
        return now if now[0] > since[0] else None

    counts: tuple[int, int] = wait_for(seen, 30, "the reader to read again")
    return counts


def release_objects(helm: Helm) -> list[tuple[str, str, str]]:
    """(kind, namespace, name) of every object of the release's current revision."""
    docs = [d for d in yaml.safe_load_all(helm("get", "manifest", RELEASE)) if d]
    return [(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"])
            for d in docs]


def plugin_image(api: Api) -> str:
    """The image the plugin's DaemonSet runs."""
    ds = api.get(f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets/{PLUGIN_DS}")
    return str(ds["spec"]["template"]["spec"]["containers"][0]["image"])


def daemonsets(api: Api) -> list[str]:
    items = api.get(f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets")["items"]
    return sorted(d["metadata"]["name"] for d in items)


def ours_left(kubectl: Kubectl) -> list[str]:
    out = kubectl("get", KINDS, "-A", "-l", "app.kubernetes.io/part-of=fuse-device-plugin",
                  "-o", "name", "--ignore-not-found")
    return out.split()


def exists(kubectl: Kubectl, kind: str, namespace: str, name: str) -> bool:
    args = ["get", kind, name, "--ignore-not-found", "-o", "name"]
    if namespace:
        args += ["-n", namespace]
    return bool(kubectl(*args).strip())


def upgrade_with_a_pod_every_second(helm: Helm, kubectl: Kubectl, api: Api, image: str,
                                    namespace: str, *values: str
                                    ) -> tuple[PodEverySecond, dict[str, str]]:
    """`helm upgrade --reset-then-reuse-values` to this chart with ``values``, every
    DaemonSet of the new revision rolled out and the slots back, with a FUSE pod created
    every second in ``namespace`` from before the upgrade to after it; returns the stream
    and the pods that did not `Succeed` (name -> the kubelet's message) or that the API
    did not create (the error -> "not created")."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}))
    with PodEverySecond(api, image, namespace) as stream:
        wait_for(lambda: len(stream.names) >= 3, 30, "three pods before the upgrade")
        helm("upgrade", RELEASE, str(CHART), "--reset-then-reuse-values", *values)
        for ds in daemonsets(api):
            rollout(kubectl, ds)
        wait_allocatable(api, DEFAULT_SLOTS)
        after = len(stream.names) + 3
        wait_for(lambda: len(stream.names) >= after, 30, "three pods after the upgrade")
    rejected = {n: str(st.get("message", "")) for n, st in stream.phases().items()
                if st.get("phase") != "Succeeded"}
    return stream, rejected | {e: "not created" for e in stream.errors}


def uninstall(helm: Helm, kubectl: Kubectl, api: Api, objects: list[tuple[str, str, str]]
              ) -> tuple[str, list[str], list[str], tuple[int | None, int | None]]:
    """`helm uninstall`, then what is left: helm's words, the objects labelled part-of
    fuse-device-plugin, the release's records, and the node's github.com/fuse (capacity,
    allocatable) once its allocatable is 0. Waits for each of ``objects`` to be gone."""
    uninstalled = helm("uninstall", RELEASE, "--wait", "--timeout=3m")
    wait_for(lambda: not any(exists(kubectl, *o) for o in objects) or None, 180,
             "every object of the release to be gone", interval=2,
             detail=lambda: str([o for o in objects if exists(kubectl, *o)]))
    records = kubectl("get", "secrets", "-n", RELEASE_NS, "-l", f"owner=helm,name={RELEASE}",
                      "-o", "name").split()

    def none_served() -> tuple[int | None, int | None] | None:
        now = fuse_resources(api)
        return now if now[1] in (0, None) else None

    served: tuple[int | None, int | None] = wait_for(
        none_served, 90, "the node's allocatable github.com/fuse to drop to 0")
    return uninstalled, ours_left(kubectl), records, served


@pytest.fixture
def reading_pod(*, helm: Helm, kubectl: Kubectl, api: Api, servers: Servers,
                images: dict[str, str], tmp_path: Path) -> Iterator[None]:
    """The release installed in the default mode, and the sshfs example reading its mount
    every 200 ms; the pod and the release are gone afterwards, whatever happened."""
    helm("install", RELEASE, str(PREVIOUS), *image_values(images, "PREVIOUS_PLUGIN_IMAGE"))
    try:
        rollout(kubectl, PLUGIN_DS)
        rollout(kubectl, INSTALLER_DS)
        wait_allocatable(api, DEFAULT_SLOTS)
        exec_in(kubectl, SERVERS_NS, "sshd", "echo helm > /srv/data/helm.txt")
        apply_sshfs_example(kubectl, servers, images, tmp_path)
        try:
            wait_mounted(kubectl, api, SSHFS_POD, "/mnt/remote", "fuse.sshfs")
            exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, READER)
            wait_for(lambda: reads(kubectl)[0] > 0 or None, 60, "the reader's first read",
                     interval=1, detail=lambda: exec_in(
                         kubectl, EXAMPLES_NS, SSHFS_POD,
                         "tail -3 /dev/shm/reads; ls -la /mnt/remote; cat /mnt/remote/helm.txt"))
            yield
        finally:
            delete_sshfs_example(kubectl, api)
    finally:
        for ns in (VERSION_NS, STREAM_NS):
            kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=false")
        if helm("list", "-q", "--filter", f"^{RELEASE}$").strip():
            helm("uninstall", RELEASE, "--wait", "--timeout=3m")


def test_install_upgrade_rollback_uninstall_with_a_pod_reading_throughout(
    *, reading_pod: None, helm: Helm, kubectl: Kubectl, api: Api, servers: Servers,
    images: dict[str, str], tmp_path: Path
) -> None:
    installed = daemonsets(api)
    image_installed = plugin_image(api)
    at_install = reads(kubectl)

    # -- from the previous version (installed by `reading_pod`, its chart and its image)
    # to this one: this chart and this image, the other values kept.
    to_this, version_rejected = upgrade_with_a_pod_every_second(
        helm, kubectl, api, images["WORKLOAD_IMAGE"], VERSION_NS, *image_values(images))
    at_version = more_reads(kubectl, at_install)
    image_upgraded = plugin_image(api)

    # -- to broker mode: the broker's DaemonSet comes, the plugin rolls with its env; a
    # FUSE pod created every second throughout.
    stream, rejected = upgrade_with_a_pod_every_second(
        helm, kubectl, api, images["WORKLOAD_IMAGE"], STREAM_NS, "--set=mode=broker")
    per_node = Counter(p["spec"].get("nodeName") for p in api.pods(STREAM_NS))
    upgraded = daemonsets(api)
    broker_env = [e for e in plugin_env(api) if e["name"] == BROKER_ENV]
    after_upgrade = more_reads(kubectl, at_version)
    BASELINE.apply(kubectl, tmp_path / "baseline", servers, images)
    try:
        via_broker = wait_example_mounted(kubectl, api, BASELINE)
    finally:
        BASELINE.delete(kubectl, api)

    # -- rollback to revision 1: the previous version's chart in the default mode again,
    # the broker's DaemonSet deleted.
    helm("rollback", RELEASE, "1")
    wait_for(lambda: BROKER_DS not in daemonsets(api) or None, 120,
             "the broker's DaemonSet to be deleted")
    rollout(kubectl, PLUGIN_DS)
    wait_allocatable(api, DEFAULT_SLOTS)
    rolled_back = daemonsets(api)
    image_rolled_back = plugin_image(api)
    env_back = [e for e in plugin_env(api) if e["name"] == BROKER_ENV]
    history = json.loads(helm("history", RELEASE, "-o", "json"))
    after_rollback = more_reads(kubectl, after_upgrade)
    still = exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, "cat /mnt/remote/helm.txt")
    objects = release_objects(helm)

    # -- uninstall: nothing of ours left in the API.
    delete_sshfs_example(kubectl, api)
    uninstalled, left, records, served = uninstall(helm, kubectl, api, objects)

    proof = evidence(
        "helm",
        f"installed {PREVIOUS.name} (default mode, image {image_installed}): DaemonSets "
        f"{installed}; reader {at_install} (ok, FAIL)",
        f"upgraded to this version (image {image_upgraded}): {len(to_this.names)} FUSE "
        "pods created one a second: "
        f"{len(to_this.names) - len(version_rejected)} Succeeded, rejected: "
        f"{version_rejected}; reader {at_version}", *to_this.errors,
        to_this.longest_wait(),
        f"upgraded to broker mode: DaemonSets {upgraded}, plugin env {broker_env}; "
        f"reader {after_upgrade}; a baseline pod mounted through the broker: {via_broker}",
        f"{len(stream.names)} FUSE pods created one a second through the upgrade, per node "
        f"{per_node}: "
        f"{len(stream.names) - len(rejected)} Succeeded, rejected: {rejected}", *stream.errors,
        stream.longest_wait(),
        f"rolled back (image {image_rolled_back}): DaemonSets {rolled_back}, plugin broker "
        f"env {env_back}; "
        f"reader {after_rollback}; the file still reads {still!r}",
        "history: " + ", ".join(f"{h['revision']} {h['chart']} {h['status']} "
                                f"{h['description']}" for h in history),
        f"release objects: {len(objects)}; uninstall: {uninstalled.strip()}",
        f"left in the API: labelled part-of {left}, release records {records}; "
        f"node github.com/fuse (capacity, allocatable) {served}")
    assert installed == sorted([PLUGIN_DS, INSTALLER_DS]), proof
    assert image_installed == image_rolled_back == images["PREVIOUS_PLUGIN_IMAGE"], proof
    assert image_upgraded == images["PLUGIN_IMAGE"], proof
    assert upgraded == sorted([PLUGIN_DS, INSTALLER_DS, BROKER_DS, LXCFS_DS]), proof
    assert broker_env, proof
    assert not stream.errors, proof
    assert not rejected, proof
    assert "fuse.sshfs" in via_broker, proof
    assert rolled_back == installed, proof
    assert env_back == [], proof
    assert not version_rejected, proof
    assert [h["chart"] for h in history] == [PREVIOUS.name.removesuffix(".tgz"), *2 * [
        f"fuse-device-plugin-{__version__}"], PREVIOUS.name.removesuffix(".tgz")], proof
    assert after_rollback[0] > after_upgrade[0] > at_install[0] > 0, proof
    assert after_rollback[1] == 0, proof  # no read failed, through every step
    assert still == "helm", proof
    assert ("Namespace", "", PLUGIN_NS) in objects, proof
    assert left == [], proof
    assert records == [], proof
