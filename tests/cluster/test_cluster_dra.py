"""The DRA driver in the one-machine 1.37 cluster: `manifests/dra/` added to manifests/ as
its header shows (the device plugin's DaemonSet goes, the driver's comes), and pods that
ask for `github.com/fuse: 1` unchanged are scheduled and prepared through DRA: the
DeviceClass's `extendedResourceName`, a ResourceSlice the driver publishes, a CDI spec
per claim that containerd 2 reads.

One change to the shipped manifests, for this cluster only: it has no kube-proxy, so the
driver cannot reach the API server through the `kubernetes` Service's address; the test's
kustomization points it at the API server's address on the node's bridge, which pods
reach (KUBERNETES_SERVICE_HOST/PORT, which in-cluster clients read).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import gpu
from tests.cluster.cluster import APISERVER_PORT, NODE_IP, NODE_NAME, Api, Cluster, Kubectl
from tests.cluster.kube import (
    APPLY,
    EXAMPLES_NS,
    MANIFESTS,
    PLUGIN_NS,
    RESOURCE,
    PodEverySecond,
    daemonset_pod,
    delete_pod,
    evidence,
    exec_in,
    pod_summary,
    restart_with_pods,
    rollout,
    wait_mounted,
    wait_ready,
    write_json,
)
from tests.cluster.servers import NAMESPACE as SERVERS_NS
from tests.cluster.servers import Servers
from tests.cluster.sshfs_example import SSHFS_POD, apply_sshfs_example, delete_sshfs_example
from tests.kubelet.node import wait_for
from tests.lib.node import host_fuse_mode

DRIVER = "fuse-device-plugin.github.com"
DRIVER_DS = "fuse-dra-driver"
DRIVER_SELECTOR = "app.kubernetes.io/component=dra-driver"
CDI_DIR = Path("/var/run/cdi")
DRA_NS = "fdp-e2e-dra"


def driver_overlay(overlay: Path, image: str, components: tuple[str, ...] = ("dra",)) -> Path:
    """`resources: [../manifests]`, `components: [../manifests/dra]` (broker mode:
    `[../manifests/broker, ../manifests/dra]`), the image set here as in manifests/
    (`kustomize edit set image` in this kustomization: the components' objects are added
    at this level), and this cluster's one patch (see the module's docstring)."""
    dst = overlay.parent / f"with-{'-'.join(components)}"
    dst.mkdir(exist_ok=True)
    patch = {"apiVersion": "apps/v1", "kind": "DaemonSet",
             "metadata": {"name": DRIVER_DS, "namespace": PLUGIN_NS},
             "spec": {"template": {"spec": {"containers": [{
                 "name": "driver", "env": [
                     {"name": "KUBERNETES_SERVICE_HOST", "value": NODE_IP},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": str(APISERVER_PORT)}]}]}}}}
    name, _, tag = image.rpartition(":")
    write_json(dst / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../{overlay.name}"],
        "components": [f"../{overlay.name}/{c}" for c in components],
        "images": [{"name": "fuse-device-plugin", "newName": name, "newTag": tag}],
        "patches": [{"patch": json.dumps(patch)}]})
    return dst


def slices(api: Api) -> list[dict[str, Any]]:
    """The ResourceSlices our driver published for this node."""
    items: list[dict[str, Any]] = api.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return [s for s in items if s["spec"].get("driver") == DRIVER
            and s["spec"].get("nodeName") == NODE_NAME]


def claim_specs() -> list[Path]:
    """The driver's CDI spec files on the node, one per prepared claim."""
    return sorted(CDI_DIR.glob(f"{DRIVER}-*.json"))


def driver_log(kubectl: Kubectl, api: Api, tail: int = 40) -> str:
    """The driver's log (its last ``tail`` lines; -1: all of it)."""
    pods = api.pods(PLUGIN_NS, DRIVER_SELECTOR)
    if not pods:
        return "no driver pod"
    return kubectl.run("-n", PLUGIN_NS, "logs", pods[0]["metadata"]["name"],
                       f"--tail={tail}", check=False).stdout


@pytest.fixture(scope="module")
def dra_deployed(cluster: Cluster, kubectl: Kubectl, api: Api, overlay: Path,
                 images: dict[str, str]) -> dict[str, Any]:
    """The driver deployed instead of the device plugin, its slice published."""
    applied = kubectl(*APPLY, "-k", str(driver_overlay(overlay, images["PLUGIN_IMAGE"]))
                      ).strip().splitlines()
    try:
        rolled = rollout(kubectl, DRIVER_DS)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{driver_log(kubectl, api)}") from None
    pod = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)
    published = wait_for(lambda: slices(api), 90, f"a ResourceSlice of {DRIVER}",
                         detail=lambda: driver_log(kubectl, api))
    plugins = [p["metadata"]["name"] for p in api.pods(PLUGIN_NS)
               if "device-plugin" in p["metadata"]["name"]]
    devices = published[0]["spec"]["devices"]
    evidence("dra-deploy", *[a for a in applied if "dra" in a or "deviceclass" in a],
             rolled, pod_summary(pod), f"device-plugin pods: {plugins or 'none'}",
             f"ResourceSlice {published[0]['metadata']['name']}: pool "
             f"{published[0]['spec']['pool']}, devices "
             f"{[d['name'] for d in devices]} (first: {json.dumps(devices[0])[:300]})")
    assert not plugins
    return pod


@pytest.fixture
def fuse_mode_0600() -> Iterator[None]:
    """The node as a fresh machine has it: /dev/fuse 0600."""
    with host_fuse_mode(0o600):
        yield


def fuse_pod(name: str, image: str, uid: int) -> dict[str, Any]:
    """A pod that asks for `github.com/fuse: 1` as a device-plugin pod would, as uid, and
    opens /dev/fuse for reading and writing."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": DRA_NS},
        "spec": {
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsUser": uid, "runAsGroup": uid,
                                "runAsNonRoot": uid != 0,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "c", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c",
                            "ls -ln /dev/fuse; (exec 3<>/dev/fuse) && echo opened /dev/fuse; "
                            "exec sleep 3600"],
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "resources": {"limits": {RESOURCE: "1"}},
            }],
        },
    }


def apply_fuse_pod(kubectl: Kubectl, name: str, images: dict[str, str], uid: int) -> None:
    """``fuse_pod`` applied, in its namespace (made if missing)."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DRA_NS}},
        fuse_pod(name, images["WORKLOAD_IMAGE"], uid)]}))


def test_one_line_pod_is_scheduled_and_prepared_through_dra_and_mounts(
    *, dra_deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    images: dict[str, str], tmp_path: Path
) -> None:
    """With the driver deployed and the device plugin not, the default-mode sshfs example
    (`github.com/fuse: 1`, unchanged) is scheduled through the DeviceClass's
    extendedResourceName: the scheduler makes a claim for it, the kubelet has the driver
    prepare it (a CDI spec appears), and the example mounts and moves data both ways.
    Deleting the pod unprepares the claim (its CDI spec goes)."""
    before = set(claim_specs())
    apply_sshfs_example(kubectl, servers, images, tmp_path)
    try:
        mount = wait_mounted(kubectl, api, SSHFS_POD, "/mnt/remote", "fuse.sshfs")
        [pod] = [p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] == SSHFS_POD]
        claims = api.get(f"/apis/resource.k8s.io/v1/namespaces/{EXAMPLES_NS}/resourceclaims")
        mine = [c for c in claims["items"] if any(
            o.get("uid") == pod["metadata"]["uid"]
            for o in c["metadata"].get("ownerReferences") or [])]
        specs = sorted(set(claim_specs()) - before)
        token = uuid.uuid4().hex
        exec_in(kubectl, SERVERS_NS, "sshd", f"echo dra-{token} > /srv/data/dra.txt")
        read = exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, "cat /mnt/remote/dra.txt")
        results = [r for c in mine for r in
                   (c.get("status") or {}).get("allocation", {}).get("devices", {})
                   .get("results", [])]
        proof = evidence(
            "dra-direct", pod_summary(pod),
            f"pod status extendedResourceClaimStatus: "
            f"{json.dumps(pod['status'].get('extendedResourceClaimStatus'))}",
            f"claims owned by the pod: {[c['metadata']['name'] for c in mine]}; "
            f"allocation results {results}",
            f"CDI specs prepared: {[s.name for s in specs]}", mount, f"server -> pod: {read}",
        ) + "\n" + driver_log(kubectl, api)
        assert mine, proof
        assert results, proof
        assert all(r["driver"] == DRIVER for r in results), proof
        assert specs, proof
        assert read == f"dra-{token}", proof
    finally:
        delete_sshfs_example(kubectl, api)
    gone = wait_for(lambda: set(claim_specs()) <= before or None, 60,
                    "the claim's CDI spec to be removed", detail=lambda: str(claim_specs()))
    evidence("dra-direct", f"pod deleted: CDI specs left of its claim: "
             f"{sorted(p.name for p in set(claim_specs()) - before) or 'none'} ({gone})")


def test_uid_1000_opens_dev_fuse_on_a_0600_node_through_the_cdi_node(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str],
    fuse_mode_0600: None
) -> None:
    """On a node whose /dev/fuse is 0600 (a fresh machine's, no udev rule), a uid-1000 pod
    that asks for `github.com/fuse: 1` opens /dev/fuse: the driver's CDI spec creates the
    container's node with mode 0666, where the device plugin's DeviceSpec copies the
    node's own mode. (A `hostUsers: false` pod gets the node's device bound instead, whose
    mode is the node's.)"""
    name = "uid1000-fuse"
    apply_fuse_pod(kubectl, name, images, 1000)
    try:
        wait_ready(api, DRA_NS, name)

        def said() -> str | None:
            out = kubectl.run("-n", DRA_NS, "logs", name, check=False).stdout
            return out if "/dev/fuse" in out else None

        out = wait_for(said, 60, f"{name}'s log")
        node = Path("/dev/fuse").stat()
        proof = evidence("dra-0600", f"the node's /dev/fuse: mode {node.st_mode & 0o7777:o}",
                         *out.splitlines())
        assert node.st_mode & 0o7777 == 0o600, proof
        assert re.search(r"^crw-rw-rw-", out, re.M), proof
        assert "opened /dev/fuse" in out, proof
    finally:
        delete_pod(kubectl, api, DRA_NS, name)


def test_kubelet_restart_keeps_running_pods_and_serves_new_ones(
    *, dra_deployed: dict[str, Any], cluster: Cluster, kubectl: Kubectl, api: Api,
    images: dict[str, str]
) -> None:
    """The kubelet restarted under a running driver: the driver registers again with the
    new kubelet by itself (no container restart), a pod prepared before keeps its
    /dev/fuse, and a new pod is prepared."""
    first, second = "before-kubelet", "after-kubelet"
    apply_fuse_pod(kubectl, first, images, 0)
    try:
        wait_ready(api, DRA_NS, first)
        driver = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)
        restarts = driver["status"]["containerStatuses"][0]["restartCount"]
        registered = driver_log(kubectl, api, -1).count(" registered ")
        cluster.restart_kubelet()
        wait_for(lambda: driver_log(kubectl, api, -1).count(" registered ") > registered, 90,
                 "the driver to register with the restarted kubelet",
                 detail=lambda: driver_log(kubectl, api))
        still = exec_in(kubectl, DRA_NS, first, "(exec 3<>/dev/fuse) && echo still opens")
        apply_fuse_pod(kubectl, second, images, 0)
        ready = wait_ready(api, DRA_NS, second)
        after = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)
        lines = [ln for ln in driver_log(kubectl, api, -1).splitlines()
                 if " registered " in ln]
        proof = evidence("dra-kubelet-restart", *lines[-2:], f"{first}: {still}",
                         pod_summary(ready), pod_summary(after))
        assert after["metadata"]["uid"] == driver["metadata"]["uid"], proof
        assert after["status"]["containerStatuses"][0]["restartCount"] == restarts, proof
        assert "still opens" in still, proof
    finally:
        for n in (first, second):
            delete_pod(kubectl, api, DRA_NS, n)


def test_driver_restart_keeps_running_pods_and_serves_new_ones(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """`kubectl delete pod` of the driver: a pod prepared by the old driver keeps its
    /dev/fuse, the new driver re-registers and republishes, and a new pod is prepared."""
    first, second = "before-restart", "after-restart"
    apply_fuse_pod(kubectl, first, images, 0)
    try:
        wait_ready(api, DRA_NS, first)
        old = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)
        kubectl("-n", PLUGIN_NS, "delete", "pod", old["metadata"]["name"], "--wait=true")
        new = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR, not_uid=old["metadata"]["uid"])
        still = exec_in(kubectl, DRA_NS, first, "(exec 3<>/dev/fuse) && echo still opens")
        apply_fuse_pod(kubectl, second, images, 0)
        ready = wait_ready(api, DRA_NS, second)
        proof = evidence("dra-restart", f"old driver {old['metadata']['name']} -> "
                         + pod_summary(new), f"{first}: {still}", pod_summary(ready),
                         f"slices: {[s['metadata']['name'] for s in slices(api)]}")
        assert "still opens" in still, proof
        assert slices(api), proof
    finally:
        for n in (first, second):
            delete_pod(kubectl, api, DRA_NS, n)


DRA_EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "dra" / "examples"
CLAIM_POD = "sshfs-claim-example"
CLAIM_NS = "fuse-dra-examples"


def claim_example_overlay(tmp: Path, servers: Servers, images: dict[str, str]) -> Path:
    """manifests/dra/examples/ as a user fills it in: the tool image, the key and the
    server's host key line, REMOTE."""
    dst = tmp / "dra-examples"
    dst.mkdir()
    for f in DRA_EXAMPLES.glob("*.yaml"):
        if f.name != "kustomization.yaml":
            (dst / f.name).write_text(f.read_text())
    name, _, tag = images["EXAMPLE_SSHFS_NONROOT_IMAGE"].rpartition(":")
    write_json(dst / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["namespace.yaml", "claim-template.yaml", "sshfs-claim-pod.yaml"],
        "images": [{"name": "fuse-example-sshfs-nonroot", "newName": name, "newTag": tag}],
        "patches": [{"patch": json.dumps(p)} for p in [
            {"apiVersion": "v1", "kind": "Secret",
             "metadata": {"name": "sshfs-key", "namespace": CLAIM_NS},
             "stringData": {"id_ed25519": servers.client_key,
                            "known_hosts": f"{servers.sshd_ip} {servers.host_key_pub}\n"}},
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": CLAIM_POD, "namespace": CLAIM_NS},
             "spec": {"containers": [{"name": "sshfs", "env": [
                 {"name": "REMOTE", "value": f"root@{servers.sshd_ip}:/srv/data"}]}]}}]]})
    return dst


def test_broker_mode_claim_mounts_at_restricted(
    *, dra_deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    overlay: Path, images: dict[str, str], tmp_path: Path
) -> None:
    """Broker mode through DRA, chosen per claim: the broker component and the driver
    (`components: [manifests/broker, manifests/dra]`), then manifests/dra/examples/: a
    ResourceClaimTemplate whose opaque config says `mode: broker` and a uid-1000 pod in a
    `restricted` namespace that mounts sshfs through the shim and the broker the claim's
    CDI spec binds into it."""
    kubectl(*APPLY, "-k", str(driver_overlay(overlay, images["PLUGIN_IMAGE"],
                                             ("broker", "dra"))))
    for ds in ("fuse-mount-broker", DRIVER_DS):
        rollout(kubectl, ds)
    kubectl(*APPLY, "-k", str(claim_example_overlay(tmp_path, servers, images)))
    try:
        mount = wait_mounted(kubectl, api, CLAIM_POD, "/mnt/remote", "fuse.sshfs",
                             namespace=CLAIM_NS)
        [pod] = [p for p in api.pods(CLAIM_NS) if p["metadata"]["name"] == CLAIM_POD]
        token = uuid.uuid4().hex
        exec_in(kubectl, SERVERS_NS, "sshd", f"echo claim-{token} > /srv/data/claim.txt")
        read = exec_in(kubectl, CLAIM_NS, CLAIM_POD, "cat /mnt/remote/claim.txt")
        status = exec_in(kubectl, CLAIM_NS, CLAIM_POD,
                         "id -u; grep -E '^CapEff:' /proc/self/status")
        specs = [json.loads(f.read_text()) for f in claim_specs()]
        binds = [m["containerPath"] for sp in specs for d in sp.get("devices", [])
                 for m in d.get("containerEdits", {}).get("mounts", [])]
        proof = evidence("dra-broker", pod_summary(pod), mount, f"server -> pod: {read}",
                         *status.splitlines(), f"CDI binds: {binds}") \
            + "\n" + driver_log(kubectl, api)
        assert "user_id=1000" in mount, proof
        assert read == f"claim-{token}", proof
        assert status.split()[0] == "1000", proof
        assert binds, proof
    finally:
        delete_pod(kubectl, api, CLAIM_NS, CLAIM_POD)


# ---------------------------------------------------------------- README pods under DRA


def broker_and_driver(kubectl: Kubectl, api: Api, overlay: Path,
                      images: dict[str, str]) -> None:
    """`components: [../manifests/broker, ../manifests/dra]`, as docs/dra.md says, rolled
    out (a no-op when it is there)."""
    kubectl(*APPLY, "-k", str(driver_overlay(overlay, images["PLUGIN_IMAGE"],
                                             ("broker", "dra"))))
    for ds in ("fuse-mount-broker", DRIVER_DS):
        rollout(kubectl, ds)


@pytest.mark.parametrize("which", ["baseline", "restricted", "userns"])
def test_readme_broker_pods_run_unchanged_under_dra(
    which: str, *, dra_deployed: dict[str, Any], servers: Servers, kubectl: Kubectl,
    api: Api, overlay: Path, images: dict[str, str], tmp_path: Path
) -> None:
    """The broker-mode pods of README.md and manifests/broker/examples/, applied unchanged
    (their one FUSE line is `github.com/fuse: 1`) on a node that runs the broker and the
    DRA driver instead of the device plugin: the scheduler makes each a claim through the
    DeviceClass, the driver prepares it in the node's mode (broker: the shim and socket
    binds), and the pod mounts sshfs through the broker at its Pod Security level, as
    root at baseline, as uid 1000 at restricted, and in its own user namespace."""
    from tests.cluster.test_cluster_broker import (
        BASELINE,
        RESTRICTED,
        USERNS,
        round_trip,
        userns_overlay,
        wait_example_mounted,
    )

    broker_and_driver(kubectl, api, overlay, images)
    example = {"baseline": BASELINE, "restricted": RESTRICTED, "userns": USERNS}[which]
    before = set(claim_specs())
    if which == "userns":
        kubectl(*APPLY, "-f", str(MANIFESTS / "broker" / "examples" / USERNS.namespace_file))
        applied, _, _ = userns_overlay(tmp_path, servers, images, as_root=False)
        kubectl(*APPLY, "-k", str(applied))
    else:
        example.apply(kubectl, tmp_path, servers, images)
    try:
        mount = wait_example_mounted(kubectl, api, example)
        [pod] = [p for p in api.pods(example.namespace)
                 if p["metadata"]["name"] == example.name]
        read, back = round_trip(kubectl, example, "/mnt/remote", f"dra-{which}")
        specs = [json.loads(f.read_text()) for f in sorted(set(claim_specs()) - before)]
        binds = [m["containerPath"] for sp in specs for d in sp.get("devices", [])
                 for m in d.get("containerEdits", {}).get("mounts", [])]
        modes = [sp.get("annotations", {}).get(f"{DRIVER}/mode") for sp in specs]
        proof = evidence(f"dra-readme-{which}", pod_summary(pod),
                         f"level {example.level}, hostUsers "
                         f"{pod['spec'].get('hostUsers', True)}, extendedResourceClaimStatus "
                         f"{json.dumps(pod['status'].get('extendedResourceClaimStatus'))}",
                         f"claim modes {modes}, CDI binds {binds}", mount, read, back)
        assert pod["status"].get("extendedResourceClaimStatus"), proof
        assert modes == ["broker"], proof
        assert "/run/fuse-broker" in binds, proof
    finally:
        if which == "userns":  # its Secret is the restricted example's, kept
            delete_pod(kubectl, api, example.namespace, example.name)
        else:
            example.delete(kubectl, api)


# ---------------------------------------------------------------- the guard


def as_driver(token: str, method: str, path: str,
              body: dict[str, Any] | None = None) -> tuple[int, str]:
    """One request to the API server with the driver's token: (status, message)."""
    import ssl
    import urllib.error
    import urllib.request

    from tests.cluster.cluster import SERVER

    ca = Path("/run/fuse-device-plugin-cluster/pki/ca.crt")
    req = urllib.request.Request(SERVER + path, method=method,
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=str(ca)),
                                    timeout=10) as answer:
            return answer.status, ""
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}").get("message", "")


def a_slice(name: str, node: str, driver: str = DRIVER) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": []}}


SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"


def update_own(token: str, api: Api) -> tuple[int, str]:
    """The driver's own slice written back as read, with its token; read again on a 409
    (the running driver may have written it in between)."""
    answer = (0, "")
    for _ in range(5):
        [own] = slices(api)
        answer = as_driver(token, "PUT", f"{SLICES_PATH}/{own['metadata']['name']}", own)
        if answer[0] != 409:
            break
    return answer


def test_the_drivers_token_writes_only_its_own_nodes_slices_of_its_own_driver(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api
) -> None:
    """With the token the kubelet gives the driver's pod (bound to the pod, so naming the
    node), the API server refuses creating, updating or deleting a slice of another node,
    and creating a slice of another driver on its own node; the driver's own slice still
    updates."""
    pod = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)
    token = kubectl("-n", PLUGIN_NS, "create", "token", DRIVER_DS, "--bound-object-kind",
                    "Pod", "--bound-object-name", pod["metadata"]["name"],
                    "--bound-object-uid", pod["metadata"]["uid"]).strip()
    other = "fdp-other-node"
    foreign = f"{other}-{DRIVER}"
    api.request("POST", SLICES_PATH, a_slice(foreign, other))
    try:
        stored = api.get(f"{SLICES_PATH}/{foreign}")
        moved = {**stored, "spec": {**stored["spec"], "devices": [{"name": "forged"}]}}
        tries = {
            "create another node's": as_driver(token, "POST", SLICES_PATH,
                                               a_slice(f"{other}-x", other)),
            "update another node's": as_driver(token, "PUT", f"{SLICES_PATH}/{foreign}",
                                               moved),
            "move another node's onto its own": as_driver(
                token, "PUT", f"{SLICES_PATH}/{foreign}",
                {**stored, "spec": {**stored["spec"], "nodeName": NODE_NAME}}),
            "delete another node's": as_driver(token, "DELETE", f"{SLICES_PATH}/{foreign}"),
            "create another driver's on its own node": as_driver(
                token, "POST", SLICES_PATH, a_slice(f"{NODE_NAME}-gpu", NODE_NAME,
                                                    "gpu.example.com")),
            "update its own": update_own(token, api),
        }
        proof = evidence("dra-guard", *(f"{what}: {code} {message}"
                                        for what, (code, message) in tries.items()))
        for what, (code, _) in tries.items():
            if what == "update its own":
                assert code == 200, proof
            elif what.startswith("move"):  # spec.nodeName is immutable: 422 before the policy
                assert code in (403, 422), proof
            else:
                assert code == 403, proof
        assert "may write only that node's" in tries["update another node's"][1], proof
        assert "only ResourceSlices of" in \
            tries["create another driver's on its own node"][1], proof
        # The forged device was never stored (an empty list is left out of the answer).
        assert not api.get(f"{SLICES_PATH}/{foreign}")["spec"].get("devices"), proof
    finally:
        api.request("DELETE", f"{SLICES_PATH}/{foreign}")


# ---------------------------------------------------------------- the slice, watched


def test_a_deleted_slice_is_back_within_seconds(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api
) -> None:
    """An admin (or the kubelet) deletes the driver's slice: its watch sees it and the
    driver writes it again, long before any resync."""
    import time

    [own] = slices(api)
    start = time.monotonic()
    api.request("DELETE", f"{SLICES_PATH}/{own['metadata']['name']}")
    back = wait_for(lambda: [s for s in slices(api)
                             if s["metadata"]["uid"] != own["metadata"]["uid"]] or None,
                    30, "the slice to be written again", detail=lambda: driver_log(kubectl, api))
    evidence("dra-slice-watch", f"deleted {own['metadata']['name']}; back as uid "
             f"{back[0]['metadata']['uid']} after {time.monotonic() - start:.2f}s",
             *[ln for ln in driver_log(kubectl, api, 10).splitlines() if "slice." in ln])


# ---------------------------------------------------------------- SIGKILL


def driver_pids() -> list[int]:
    """The node's `fuse-device-plugin dra` processes (the driver containers')."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dra" in argv and any(a.endswith(b"fuse-device-plugin") for a in argv[:2]):
            found.append(int(proc.name))
    return found


def test_a_sigkilled_driver_keeps_prepared_claims_and_removes_orphans(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """The driver SIGKILLed while a pod it prepared runs, with an orphaned spec (its claim
    long gone) and a half-written temp file on the node: the kubelet restarts the
    container; the running pod's spec is kept, the orphan and the temp file are removed,
    and deleting the pod still unprepares its claim."""
    import os
    import signal

    name = "before-sigkill"
    apply_fuse_pod(kubectl, name, images, 0)
    try:
        wait_ready(api, DRA_NS, name)
        live = set(claim_specs())
        ghost_uid = str(uuid.uuid4())
        orphan = CDI_DIR / f"{DRIVER}-fuse_{ghost_uid}.json"
        orphan.write_text(json.dumps({
            "cdiVersion": "0.6.0", "kind": f"{DRIVER}/fuse",
            "annotations": {f"{DRIVER}/claim": f"{DRA_NS}/ghost-claim",
                            f"{DRIVER}/mode": "direct", f"{DRIVER}/devices": "[]"},
            "devices": [{"name": ghost_uid, "containerEdits": {"deviceNodes": [
                {"path": "/dev/fuse", "hostPath": "/dev/fuse", "type": "c", "major": 10,
                 "minor": 229}]}}]}))
        leftover = CDI_DIR / f".{DRIVER}-fuse_{uuid.uuid4()}.json.k1ll3d.tmp"
        leftover.write_text("{")
        old = daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)
        restarts = old["status"]["containerStatuses"][0]["restartCount"]
        pids = driver_pids()
        assert pids, "no driver process found on the node"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: daemonset_pod(api, PLUGIN_NS, DRIVER_SELECTOR)["status"][
            "containerStatuses"][0]["restartCount"] > restarts or None, 120,
            "the kubelet to restart the driver's container")
        wait_for(lambda: (not orphan.exists() and not leftover.exists()) or None, 60,
                 "the orphan and the temp file to be removed",
                 detail=lambda: driver_log(kubectl, api))
        kept = live <= set(claim_specs())
        still = exec_in(kubectl, DRA_NS, name, "(exec 3<>/dev/fuse) && echo still opens")
        lines = [ln for ln in driver_log(kubectl, api, -1).splitlines()
                 if "claims.found" in ln or "orphan" in ln or "leftover" in ln]
        proof = evidence("dra-sigkill", f"killed {pids}; live specs kept: {kept}",
                         f"orphan removed: {not orphan.exists()}, temp file removed: "
                         f"{not leftover.exists()}", f"{name}: {still}", *lines)
        assert kept, proof
        assert "still opens" in still, proof
    finally:
        delete_pod(kubectl, api, DRA_NS, name)
    wait_for(lambda: not (live & set(claim_specs())) or None, 60,
             "the pod's claim to be unprepared by the restarted driver")


# ---------------------------------------------------------------- rollout


# The API server's node authorizer learns which claims a node may read from its own
# informer (plugin/pkg/auth/authorizer/node/graph_populator.go): a kubelet that asks for a
# pod's extended-resource claim before the authorizer has seen the scheduler write it to
# the pod's status is refused once ("no relationship found between node ...") and
# retries. Not the driver's doing, and the pod starts.
AUTHORIZER_LAG = "no relationship found between node"
# The driver's log events of its stop: calls finished, left, or come while it stopped.
DRAIN_WORDS = ("signal", "calls.", "call.while_stopping")
ROLLOUT_NS = "fdp-e2e-dra-rollout"


def prepare_waits(api: Api, namespace: str, names: list[str]) -> tuple[list[str], list[str]]:
    """The pods' FailedPrepareDynamicResources events ("pod: message"): those that name
    the driver or anything but the authorizer's lag, and the authorizer's lag."""
    ours: list[str] = []
    lag: list[str] = []
    for name in names:
        for e in api.events(namespace, name):
            if e.get("reason") == "FailedPrepareDynamicResources":
                message = e.get("message", "")
                (lag if AUTHORIZER_LAG in message else ours).append(f"{name}: {message}")
    return ours, lag


def rollout_outcome(ended: dict[str, dict[str, Any]]) -> tuple[dict[str, str], list[str]]:
    """Of a PodEverySecond's ended pods: those that did not succeed (name -> why), and
    those not served through a DRA claim (the scheduler's extended-resource claim)."""
    failed = {n: st.get("message", "") for n, st in ended.items()
              if st.get("phase") != "Succeeded"}
    return failed, sorted(n for n, st in ended.items()
                          if not st.get("extendedResourceClaimStatus"))


def test_driver_rollout_serves_every_new_pod_without_waiting_for_registration(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """`kubectl rollout restart` of the driver while a new FUSE pod is created every
    second: the new driver pod registers beside the old one (its own socket names,
    maxSurge), so every pod is served through a DRA claim and `Succeeded`, none with a
    FailedPrepareDynamicResources event of the driver's."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ROLLOUT_NS}}))
    try:
        stream = PodEverySecond(api, images["WORKLOAD_IMAGE"], ROLLOUT_NS)
        status, _, took, sampler, followed = restart_with_pods(
            kubectl, api, stream, DRIVER_DS, DRIVER_SELECTOR)
        failed, not_dra = rollout_outcome(stream.phases())
        waited, lag = prepare_waits(api, ROLLOUT_NS, stream.names)
        proof = evidence(
            "dra-rollout", status, f"rollout restart took {took:.1f}s, the driver "
            f"replaced on {sampler.replaced()}, {len(sampler.samples)} samples",
            f"{len(stream.names)} FUSE pods created one a second: "
            f"{len(stream.names) - len(failed)} Succeeded, failed: {failed}", *stream.errors,
            stream.longest_wait(),
            f"not served through a DRA claim: {not_dra}",
            f"FailedPrepareDynamicResources events: {len(waited)}", *waited[:3],
            f"the node authorizer's lag (retried by the kubelet): {len(lag)}", *lag[:3],
            "the old driver's stop:", *followed.lines(*DRAIN_WORDS))
        assert "successfully rolled out" in status, proof
        assert sampler.replaced(), proof
        assert not stream.errors, proof
        assert not failed, proof
        assert not not_dra, proof
        assert not waited, proof
    finally:
        kubectl("delete", "namespace", ROLLOUT_NS, "--ignore-not-found", "--wait=true",
                timeout=180)


def test_a_fuse_pod_sees_no_gpu_under_dra(
    *, dra_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """As with the device plugin: the claim's CDI device is /dev/fuse alone."""
    gpu.prove_isolation(kubectl, api, images["WORKLOAD_IMAGE"], "dra")
