"""Two nodes (issue 35): the first node as in every module, and a second one built as kind
builds nodes (tests/cluster/worker.py: its own kubelet and containerd in mount and
network namespaces of their own, on the same bridge, from the same stack). What only
more than one node shows: the DaemonSets run on each, a rollout goes node by node, the
scheduler places FUSE pods by each node's slots, a drain moves FUSE pods to the other
node where they mount, and under DRA each node's driver publishes its own slice."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import servers as servermod
from tests.cluster.cluster import NODE_NAME, Api, Cluster, Kubectl, pod_ready
from tests.cluster.kube import (
    APPLY,
    BROKER_DS,
    DEFAULT_SLOTS,
    EXAMPLES_NS,
    INSTALLER_DS,
    INSTALLER_SELECTOR,
    LXCFS_DS,
    PLUGIN_DS,
    PLUGIN_NS,
    PLUGIN_SELECTOR,
    RESOURCE,
    SLOTS_ENV,
    PodEverySecond,
    device_check_pod,
    events_text,
    evidence,
    exec_in,
    fuse_pod,
    manifests_overlay,
    one_ready_per_node,
    plugin_env,
    pod_summary,
    pods_by_node,
    quantity,
    restart_with_pods,
    rollout,
    wait_gone,
    wait_mounted,
)
from tests.cluster.sshfs_example import apply_sshfs_example, delete_sshfs_example
from tests.cluster.test_cluster_broker import (
    BASELINE,
    BROKER_EXAMPLES,
    BROKER_SELECTOR,
    edit_add_component,
)
from tests.cluster.test_cluster_dra import (
    DRAIN_WORDS,
    DRIVER,
    DRIVER_DS,
    DRIVER_SELECTOR,
    driver_overlay,
    prepare_waits,
    rollout_outcome,
)
from tests.cluster.test_cluster_dra_switch import to_dra
from tests.cluster.worker import Worker
from tests.kubelet.node import DEVICE_PLUGIN_DIR, wait_for

CLUSTER_NODES = 2
NODE2 = f"{NODE_NAME}2"
NODES = (NODE_NAME, NODE2)


def allocatable(api: Api) -> dict[str, int | None]:
    """Each node's allocatable github.com/fuse."""
    return {n: quantity(api.node(n)["status"].get("allocatable", {}).get(RESOURCE))
            for n in NODES}


def wait_slots(api: Api, slots: int) -> str:
    """Wait until every node's capacity and allocatable are ``slots``; returns the line."""
    def seen() -> str | None:
        got = {n: (quantity(api.node(n)["status"].get("capacity", {}).get(RESOURCE)),
                   allocatable(api)[n]) for n in NODES}
        return (f"{RESOURCE} capacity/allocatable per node: {got}"
                if all(v == (slots, slots) for v in got.values()) else None)

    line: str = wait_for(seen, 120, f"every node's {RESOURCE} at {slots}", interval=0.5,
                         detail=lambda: str(allocatable(api)))
    return line





@pytest.fixture(scope="module")
def worker(cluster: Cluster) -> Worker:
    w = cluster.workers[0]
    assert isinstance(w, Worker)
    return w


@pytest.fixture
def deployed(cluster: Cluster, kubectl: Kubectl, api: Api,
             overlay: Path) -> dict[str, dict[str, Any]]:
    """`kubectl apply -k` of the manifests, the plugin at its default slots on both nodes;
    returns the plugin's Ready pod on each node."""
    kubectl(*APPLY, "-k", str(overlay))
    if any(e["name"] == SLOTS_ENV for e in plugin_env(api)):
        kubectl("-n", PLUGIN_NS, "set", "env", f"daemonset/{PLUGIN_DS}", f"{SLOTS_ENV}-")
    rollout(kubectl, PLUGIN_DS)
    rollout(kubectl, INSTALLER_DS)
    wait_slots(api, DEFAULT_SLOTS)
    return one_ready_per_node(api, PLUGIN_SELECTOR)


def test_daemonsets_run_on_both_nodes_each_with_its_own_paths(
        deployed: dict[str, dict[str, Any]], worker: Worker, api: Api) -> None:
    """The plugin and the installer run once on each node, each plugin registers with its
    own node's kubelet (each Node shows the default slots), and each installer writes the
    seccomp profiles into its own node's kubelet root: the second node's files are in its
    own directory, not only the first node's /var/lib/kubelet."""
    installers = one_ready_per_node(api, INSTALLER_SELECTOR)
    line = wait_slots(api, DEFAULT_SLOTS)
    profiles = sorted(p.name for p in
                      (worker.kubelet_root / "seccomp" / "fuse-device-plugin").glob("*.json"))
    sockets = sorted(p.name for p in (worker.kubelet_root / "device-plugins").glob("github*"))
    proof = evidence(
        "two-nodes", *(f"plugin on {n}: {pod_summary(p)}" for n, p in deployed.items()),
        *(f"installer on {n}: {pod_summary(p)}" for n, p in installers.items()), line,
        f"{NODE2}'s kubelet root {worker.kubelet_root}: seccomp profiles {profiles}, "
        f"plugin sockets {sockets}")
    assert set(deployed) == set(installers) == set(NODES), proof
    assert "sshfs.json" in profiles, proof
    first = {p.name for p in DEVICE_PLUGIN_DIR.glob("github*")}
    assert sockets, proof
    assert not first & set(sockets), proof


SCHED_NS = "fdp-e2e-two-sched"


def placed_or_refused(api: Api, name: str) -> bool:
    """The scheduler has bound the pod to a node or said why it cannot."""
    pod = api.get(f"/api/v1/namespaces/{SCHED_NS}/pods/{name}")
    return bool(pod["spec"].get("nodeName")) or "Insufficient" in events_text(
        api, SCHED_NS, name)


def test_scheduler_fills_one_node_then_places_on_the_other(
        deployed: dict[str, dict[str, Any]], kubectl: Kubectl, api: Api,
        images: dict[str, str]) -> None:
    """The plugin at 2 slots on each node and five FUSE pods that prefer the first node:
    two run there, the next two on the second node once the first has no slot, and the
    fifth stays Pending with `0/2 nodes are available: 2 Insufficient github.com/fuse`."""
    kubectl("-n", PLUGIN_NS, "set", "env", f"daemonset/{PLUGIN_DS}", f"{SLOTS_ENV}=2")
    names = [f"fuse-{i}" for i in range(5)]
    prefer_first = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "preference": {"matchExpressions": [{
            "key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME]}]}}]}}
    try:
        rollout(kubectl, PLUGIN_DS)
        two = wait_slots(api, 2)
        kubectl(*APPLY, "-f", "-", stdin=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SCHED_NS}}))
        for n in names:  # one at a time: each placed knowing where the last one went
            pod = fuse_pod(n, images["WORKLOAD_IMAGE"], SCHED_NS)
            pod["spec"]["affinity"] = prefer_first
            api.request("POST", f"/api/v1/namespaces/{SCHED_NS}/pods", pod)
            wait_for(functools.partial(placed_or_refused, api, n), 60,
                     f"{n} placed or refused", interval=0.5)

        def split() -> tuple[dict[str, list[str]], list[str]] | None:
            pods = api.pods(SCHED_NS)
            running = {n: sorted(p["metadata"]["name"] for p in pods if pod_ready(p)
                                 and p["spec"].get("nodeName") == n) for n in NODES}
            pending = [p["metadata"]["name"] for p in pods if not p["spec"].get("nodeName")]
            return (running, pending) if sum(map(len, running.values())) == 4 else None

        running, pending = wait_for(
            split, 120, "four FUSE pods Running", interval=0.5,
            detail=lambda: "\n".join(pod_summary(p) for p in api.pods(SCHED_NS)))
        why = events_text(api, SCHED_NS, pending[0]) if pending else ""
        proof = evidence("two-nodes-scheduler", two, f"Running per node: {running}",
                         f"Pending: {pending}", why)
        assert running == {NODE_NAME: names[:2], NODE2: names[2:4]}, proof
        assert pending == names[4:], proof
        assert "0/2 nodes are available: 2 Insufficient github.com/fuse" in why, proof
    finally:
        kubectl("delete", "namespace", SCHED_NS, "--ignore-not-found", "--wait=true",
                timeout=180)
        kubectl("-n", PLUGIN_NS, "set", "env", f"daemonset/{PLUGIN_DS}", f"{SLOTS_ENV}-")
        rollout(kubectl, PLUGIN_DS)
        wait_slots(api, DEFAULT_SLOTS)


ROLL_NS = "fdp-e2e-two-rollout"


def test_rollout_goes_node_by_node_and_rejects_no_fuse_pod(
        deployed: dict[str, dict[str, Any]], kubectl: Kubectl, api: Api,
        images: dict[str, str]) -> None:
    """`kubectl rollout restart` of the plugin on two nodes with a FUSE pod created every
    second throughout: the DaemonSet surges one node at a time (maxSurge 1), each node's
    new pod Ready before its old one goes, both nodes end on new pods, and every FUSE pod,
    on either node, `Succeeded` (none rejected)."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ROLL_NS}}))
    old = {n: p["metadata"]["uid"] for n, p in deployed.items()}
    try:
        stream = PodEverySecond(api, images["WORKLOAD_IMAGE"], ROLL_NS)
        status, new, took, sampler, followed = restart_with_pods(
            kubectl, api, stream, PLUGIN_DS, PLUGIN_SELECTOR)
        ended = stream.phases()
        line = wait_slots(api, DEFAULT_SLOTS)
        rejected = {n: st.get("message", "") for n, st in ended.items()
                    if st.get("phase") != "Succeeded"}
        per_node = {n: sum(st.get("nodeName") == n for st in ended.values()) for n in NODES}
        proof = evidence(
            "two-nodes-rollout", status, line, f"rollout restart took {took:.1f}s",
            f"surge order {sampler.order()}, most nodes surging at once: "
            f"{sampler.surging_at_once()} ({len(sampler.samples)} samples)",
            f"{len(ended)} FUSE pods created one a second, per node {per_node}: "
            f"{len(ended) - len(rejected)} Succeeded, rejected: {rejected}", *stream.errors,
            stream.longest_wait(), "the old plugins' stop:",
            *followed.lines("signal", "handoff."))
        assert "successfully rolled out" in status, proof
        assert all(new[n]["metadata"]["uid"] != old[n] for n in NODES), proof
        assert sorted(sampler.order()) == sorted(NODES), proof
        assert sampler.surging_at_once() == 1, proof
        assert all(per_node.values()), proof
        assert not stream.errors, proof
        assert not rejected, proof
    finally:
        kubectl("delete", "namespace", ROLL_NS, "--ignore-not-found", "--wait=true",
                timeout=180)


@pytest.fixture(scope="module")
def servers(cluster: Cluster, kubectl: Kubectl, api: Api, images: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> servermod.Servers:
    """The servers on the first node (the second cordoned while they are placed): the
    drain test empties the second."""
    kubectl("cordon", NODE2)
    try:
        return servermod.start(kubectl, api, images["SERVERS_IMAGE"],
                               tmp_path_factory.mktemp("sshkeys"))
    finally:
        kubectl("uncordon", NODE2)


SSHFS_DEPLOYMENT = "sshfs-moves"
TEMPLATE_POD = "sshfs-template"


def sshfs_deployment(kubectl: Kubectl, api: Api, servers: servermod.Servers,
                     images: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    """manifests/examples/sshfs-pod.yaml filled in as a user would (its Secret applied),
    its pod as the template of a two-replica Deployment that prefers the second node. The
    template pod is gone before this returns: a bare pod left on the second node makes
    `kubectl drain` refuse."""
    rendered = tmp_path / "rendered"
    apply_sshfs_example(kubectl, servers, images, rendered, name=TEMPLATE_POD)
    pod = json.loads(kubectl("-n", EXAMPLES_NS, "get", "pod", TEMPLATE_POD, "-o", "json"))
    kubectl("-n", EXAMPLES_NS, "delete", "pod", TEMPLATE_POD, "--grace-period=1",
            "--wait=false")
    wait_gone(api, EXAMPLES_NS, TEMPLATE_POD)
    spec = {k: v for k, v in pod["spec"].items()
            if k not in ("nodeName", "serviceAccountName", "serviceAccount", "tolerations",
                         "schedulerName", "priority", "enableServiceLinks",
                         "preemptionPolicy", "securityContext", "dnsPolicy",
                         "restartPolicy")}
    spec["terminationGracePeriodSeconds"] = 1
    spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "preference": {"matchExpressions": [{
            "key": "kubernetes.io/hostname", "operator": "In", "values": [NODE2]}]}}]}}
    labels = {"app": SSHFS_DEPLOYMENT}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": SSHFS_DEPLOYMENT, "namespace": EXAMPLES_NS},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": spec}}}


def mounted_on(kubectl: Kubectl, api: Api, node: str) -> dict[str, str]:
    """The Deployment's two pods Ready on ``node``, each with its sshfs mount: pod -> the
    mount's /proc/mounts line."""
    def two() -> list[str] | None:
        pods = [p for p in api.pods(EXAMPLES_NS, f"app={SSHFS_DEPLOYMENT}")
                if "deletionTimestamp" not in p["metadata"]]
        on = [p["metadata"]["name"] for p in pods
              if p["spec"].get("nodeName") == node and p["status"].get("phase") == "Running"]
        return on if len(on) == len(pods) == 2 else None

    names = wait_for(two, 180, f"two {SSHFS_DEPLOYMENT} pods Running on {node}", interval=1,
                     detail=lambda: "\n".join(
                         pod_summary(p) + f" node={p['spec'].get('nodeName')}"
                         for p in api.pods(EXAMPLES_NS, f"app={SSHFS_DEPLOYMENT}")))
    return {n: wait_mounted(kubectl, api, n, "/mnt/remote", "fuse.sshfs") for n in names}


def test_drain_moves_a_fuse_deployment_to_the_other_node_where_it_mounts(
        *, deployed: dict[str, dict[str, Any]], servers: servermod.Servers, kubectl: Kubectl,
        api: Api, images: dict[str, str], tmp_path: Path) -> None:
    """The sshfs example as a two-replica Deployment, both pods on the second node with
    their mounts; `kubectl drain` of that node (DaemonSets ignored, as an operator does):
    the pods are evicted, the Deployment's new pods run on the first node and mount, and
    each writes and reads a file through its mount there."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        sshfs_deployment(kubectl, api, servers, images, tmp_path)))
    try:
        before = mounted_on(kubectl, api, NODE2)
        began = time.monotonic()
        drained = kubectl("drain", NODE2, "--ignore-daemonsets", "--delete-emptydir-data",
                          "--grace-period=1", "--timeout=180s", timeout=200).strip()
        after = mounted_on(kubectl, api, NODE_NAME)
        took = time.monotonic() - began
        io = {n: exec_in(kubectl, EXAMPLES_NS, n,
                         f"echo {n} > /mnt/remote/{n}.txt && cat /mnt/remote/{n}.txt")
              for n in after}
        proof = evidence(
            "two-nodes-drain", *(f"before, on {NODE2}: {n}: {ln}" for n, ln in before.items()),
            *drained.splitlines()[-3:],
            *(f"after, on {NODE_NAME}: {n}: {ln}" for n, ln in after.items()),
            f"drain -> two pods mounted on {NODE_NAME}: {took:.1f}s",
            *(f"{n} write/read: {out}" for n, out in io.items()))
        assert "drained" in drained, proof
        assert not set(before) & set(after), proof
        assert all(out == n for n, out in io.items()), proof
        assert not pods_by_node(api, EXAMPLES_NS, f"app={SSHFS_DEPLOYMENT}")[NODE2], proof
    finally:
        kubectl("uncordon", NODE2)
        kubectl("-n", EXAMPLES_NS, "delete", "deployment", SSHFS_DEPLOYMENT,
                "--ignore-not-found", "--wait=true", timeout=120)
        for p in api.pods(EXAMPLES_NS, f"app={SSHFS_DEPLOYMENT}"):
            wait_gone(api, EXAMPLES_NS, p["metadata"]["name"])
        delete_sshfs_example(kubectl, api, TEMPLATE_POD)


BROKER_NS = BASELINE.namespace
BROKER_KEY = BASELINE.doc("Secret")["metadata"]["name"]


@pytest.fixture
def broker_on_both(cluster: Cluster, kubectl: Kubectl, api: Api, images: dict[str, str],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Broker mode as the README deploys it (manifests/ with `kustomize edit add component
    broker`) on both nodes; returns each node's Ready broker pod. Afterwards the broker
    mode's own DaemonSets are deleted; the next test's `deployed` re-applies default
    mode."""
    overlay = manifests_overlay(tmp_path_factory.mktemp("broker-overlay"),
                                images["PLUGIN_IMAGE"])
    edit_add_component(overlay, "broker")
    kubectl(*APPLY, "-k", str(overlay))
    try:
        for ds in (BROKER_DS, LXCFS_DS, PLUGIN_DS, INSTALLER_DS):
            rollout(kubectl, ds)
        wait_slots(api, DEFAULT_SLOTS)
        yield one_ready_per_node(api, BROKER_SELECTOR)
    finally:
        kubectl("-n", PLUGIN_NS, "delete", "daemonset", BROKER_DS, LXCFS_DS,
                "--ignore-not-found", "--wait=true", timeout=180)


def taking_turns(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod of a PodEverySecond (`roll-N`) bound for NODES[N % 2]: the scheduler may
    put a stream all on one node, and a rollout test needs pods on each."""
    n = int(pod["metadata"]["name"].rsplit("-", 1)[1])
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODES[n % len(NODES)]}
    return pod


def mounting_pod(servers: servermod.Servers, image: str,
                 name: str) -> dict[str, Any]:
    """manifests/broker/examples/sshfs-pod.yaml's pod (baseline, RuntimeDefault, no
    capability, its one FUSE line) as a pod that mounts, writes and reads a file of its
    own through the mount, unmounts, and ends: `Succeeded` only if all of that worked."""
    pod = BASELINE.pod
    pod["metadata"] = {"name": name, "namespace": BROKER_NS}
    spec = pod["spec"]
    spec["restartPolicy"] = "Never"
    spec["terminationGracePeriodSeconds"] = 1
    [c] = spec["containers"]
    c["image"] = image
    c["env"] = [{"name": "REMOTE", "value": f"root@{servers.sshd_ip}:/srv/data"}]
    c["args"] = [
        "set -e\n"
        'sshfs "$REMOTE" /mnt/remote -o IdentityFile=/etc/sshfs/id_ed25519 '
        "-o UserKnownHostsFile=/etc/sshfs/known_hosts\n"
        "echo \"$HOSTNAME\" > /mnt/remote/$HOSTNAME.txt\n"
        'test "$(cat /mnt/remote/$HOSTNAME.txt)" = "$HOSTNAME"\n'
        "fusermount3 -u /mnt/remote\n"
        "echo ROUND-TRIP-OK\n"]
    return pod


def test_broker_rollout_goes_node_by_node_and_fails_no_mount(
        broker_on_both: dict[str, Any], servers: servermod.Servers, kubectl: Kubectl,
        api: Api, images: dict[str, str]) -> None:
    """`kubectl rollout restart` of the broker on two nodes, with a broker-mode pod created
    every second throughout that mounts sshfs through the shim, writes and reads a file
    and unmounts: each node's broker is replaced, and every pod, on either node,
    `Succeeded` (0 mounts failed); the pods that met a restarting broker say so in their
    logs (the shim's one line), and waited."""
    kubectl(*APPLY, "-f", str(BROKER_EXAMPLES / BASELINE.namespace_file))
    kubectl(*APPLY, "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": BROKER_KEY, "namespace": BROKER_NS},
        "stringData": {"id_ed25519": servers.client_key,
                       "known_hosts": f"{servers.sshd_ip} {servers.host_key_pub}\n"}}))
    old = {n: p["metadata"]["uid"] for n, p in broker_on_both.items()}
    def make(name: str) -> dict[str, Any]:
        return taking_turns(mounting_pod(servers, images["EXAMPLE_SSHFS_IMAGE"], name))

    try:
        stream = PodEverySecond(api, "", BROKER_NS, make)
        status, new, took, sampler, followed = restart_with_pods(
            kubectl, api, stream, BROKER_DS, BROKER_SELECTOR)
        ended = stream.phases()
        logs = {n: kubectl.run("-n", BROKER_NS, "logs", n, check=False).stdout
                for n in ended}
        failed = {n: f"{st.get('phase')} {st.get('message', '')} {logs[n][-300:]}"
                  for n, st in ended.items()
                  if st.get("phase") != "Succeeded" or "ROUND-TRIP-OK" not in logs[n]}
        waited = {n: ln for n, out in logs.items() for ln in out.splitlines()
                  if "restart" in ln}
        per_node = {n: sum(st.get("nodeName") == n for st in ended.values()) for n in NODES}
        proof = evidence(
            "two-nodes-broker-rollout", status, f"rollout restart took {took:.1f}s",
            f"brokers replaced in the order {sampler.replaced()}, most nodes without a "
            f"broker at once: {sampler.most_without()} ({len(sampler.samples)} samples)",
            f"{len(ended)} mounting pods created one a second, per node {per_node}: "
            f"{len(ended) - len(failed)} mounted, wrote, read and unmounted; failed: "
            f"{failed}", f"{len(waited)} met a restarting broker and waited: "
            f"{sorted(waited.values())[:3]}", *stream.errors, stream.longest_wait(),
            "the old brokers' stop:", *followed.lines("signal", "stopped"))
        assert "successfully rolled out" in status, proof
        assert all(new[n]["metadata"]["uid"] != old[n] for n in NODES), proof
        assert sorted(sampler.replaced()) == sorted(NODES), proof
        assert sampler.most_without() <= 1, proof
        assert all(per_node.values()), proof
        assert not stream.errors, proof
        assert not failed, proof
    finally:
        kubectl("-n", BROKER_NS, "delete", "pods", "--all", "--wait=true", timeout=180)
        kubectl("-n", BROKER_NS, "delete", "secret", BROKER_KEY, "--ignore-not-found")


@pytest.fixture
def dra_on_both(deployed: dict[str, dict[str, Any]], kubectl: Kubectl, api: Api,
                overlay: Path, images: dict[str, str]) -> Iterator[dict[str, dict[str, Any]]]:
    """The DRA driver deployed beside the plugin's manifests, then docs/dra.md's switch
    (nodes cordoned, the plugin's DaemonSet deleted, allocatable 0, uncordoned); the
    plugin's manifests re-applied afterwards."""
    kubectl(*APPLY, "-k", str(driver_overlay(overlay, images["PLUGIN_IMAGE"])))
    try:
        rollout(kubectl, DRIVER_DS)
        to_dra(kubectl)
        yield one_ready_per_node(api, DRIVER_SELECTOR)
    finally:
        # docs/dra.md's removal of the driver; the next test's `deployed` re-applies the
        # plugin.
        kubectl("delete", "-A", "-l", "app.kubernetes.io/name=fuse-dra-driver",
                "daemonset,serviceaccount,networkpolicy,deviceclass,clusterrole,"
                "clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding",
                "--wait=true", timeout=180)


def test_each_nodes_dra_driver_publishes_its_own_slice(
        dra_on_both: dict[str, dict[str, Any]], api: Api) -> None:
    """Under DRA, the driver's pod on each node publishes a ResourceSlice for its own node
    (spec.nodeName, and a pool named after the node), not one for both."""
    def per_node() -> dict[str, dict[str, Any]] | None:
        items = api.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
        mine = {s["spec"].get("nodeName"): s for s in items if s["spec"]["driver"] == DRIVER}
        return mine if set(mine) == set(NODES) else None

    slices = wait_for(per_node, 90, f"a ResourceSlice of {DRIVER} for each node", interval=1)
    proof = evidence("two-nodes-dra", *(f"driver on {n}: {pod_summary(p)}"
                                        for n, p in dra_on_both.items()),
                     *(f"ResourceSlice {s['metadata']['name']}: nodeName {n}, pool "
                       f"{s['spec']['pool']['name']}, devices "
                       f"{[d['name'] for d in s['spec'].get('devices') or []]}"
                       for n, s in slices.items()))
    assert all(s["spec"]["pool"]["name"] == n for n, s in slices.items()), proof


DRA_ROLL_NS = "fdp-e2e-two-dra-rollout"


def test_driver_rollout_goes_node_by_node_and_fails_no_pod(
        dra_on_both: dict[str, dict[str, Any]], kubectl: Kubectl, api: Api,
        images: dict[str, str]) -> None:
    """Under DRA, `kubectl rollout restart` of the driver on two nodes with a pod asking
    `github.com/fuse: 1` (the DeviceClass's extended resource) created every second
    throughout: each node's driver replaced, and every pod, on either node, prepared and
    `Succeeded`, none with a FailedPrepareDynamicResources event of the driver's (the
    API server's node authorizer's lag is counted apart: see AUTHORIZER_LAG)."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DRA_ROLL_NS}}))
    old = {n: p["metadata"]["uid"] for n, p in dra_on_both.items()}
    try:
        stream = PodEverySecond(api, "", DRA_ROLL_NS, lambda name: taking_turns(
            device_check_pod(name, images["WORKLOAD_IMAGE"], DRA_ROLL_NS)))
        status, new, took, sampler, followed = restart_with_pods(
            kubectl, api, stream, DRIVER_DS, DRIVER_SELECTOR)
        ended = stream.phases()
        failed, not_dra = rollout_outcome(ended)
        waited, lag = prepare_waits(api, DRA_ROLL_NS, stream.names)
        per_node = {n: sum(st.get("nodeName") == n for st in ended.values()) for n in NODES}
        proof = evidence(
            "two-nodes-dra-rollout", status, f"rollout restart took {took:.1f}s",
            f"drivers replaced in the order {sampler.replaced()}, surging on at most "
            f"{sampler.surging_at_once()} node at once ({len(sampler.samples)} samples)",
            f"{len(ended)} FUSE pods created one a second, per node {per_node}: "
            f"{len(ended) - len(failed)} Succeeded, failed: {failed}",
            f"not served through a DRA claim: {not_dra}",
            f"FailedPrepareDynamicResources events: {len(waited)}", *waited[:3],
            f"the node authorizer's lag (retried by the kubelet): {len(lag)}", *lag[:3],
            *stream.errors, stream.longest_wait(),
            "the old drivers' stop:", *followed.lines(*DRAIN_WORDS))
        assert "successfully rolled out" in status, proof
        assert all(new[n]["metadata"]["uid"] != old[n] for n in NODES), proof
        assert sorted(sampler.replaced()) == sorted(NODES), proof
        assert all(per_node.values()), proof
        assert not stream.errors, proof
        assert not failed, proof
        assert not not_dra, proof
        assert not waited, proof
    finally:
        kubectl("delete", "namespace", DRA_ROLL_NS, "--ignore-not-found", "--wait=true",
                timeout=180)
