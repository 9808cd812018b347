"""Broker mode in the one-machine cluster (issues 20 and 21): the component deployed as
the README's "Broker mode" section tells a user, on a node that never ran it, and the
examples in manifests/broker/examples/ run through it.

- The deploy: manifests/ copied with the README's image (`kustomize edit set image`) and
  the broker component added (`kustomize edit add component broker`), then `kubectl
  apply -k`. No kustomize binary is on this machine and kubectl has no `edit`, so both
  edits are made to the copy's kustomization.yaml as kustomize writes them (`images:` and
  `components: [broker]`); `kubectl kustomize` / `apply -k` then build it for real.
- The examples are the shipped files, changed only where test_cluster.py changes the
  others (the tool image's name, the key, the host key line, REMOTE), by kustomize
  patches.
- The 1.20 API server has no Pod Security admission (1.23+): the namespaces' levels are
  stored and ignored, so each example pod is checked against the level's rules here
  (tests/unit/test_manifests_broker.py's baseline_violations / restricted_violations).
  Nor does it know `hostUsers` (1.25+): the user-namespaced variant is only shown to be
  refused or dropped (test_old_api_server_cannot_run_the_userns_variant).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fuse_plugin.broker import protocol, settings
from tests.cluster import gpu
from tests.cluster.cluster import Api, Cluster, Kubectl, pod_ready
from tests.cluster.kube import (
    APPLY,
    BROKER_DS,
    DEFAULT_SLOTS,
    INSTALLER_DS,
    MANIFESTS,
    PLUGIN_DS,
    PLUGIN_NS,
    PLUGIN_SELECTOR,
    RESOURCE,
    daemonset_pod,
    delete_pod,
    evidence,
    exec_in,
    fuse_resources,
    manifests_overlay,
    pod_summary,
    rollout,
    seccomp_seen,
    wait_allocatable,
    wait_mounted,
    wait_pod,
    write_json,
)
from tests.cluster.servers import NAMESPACE as SERVERS_NS
from tests.cluster.servers import Servers
from tests.kubelet.node import wait_for
from tests.lib.manifests import baseline_violations, restricted_violations
from tests.lib.waiting import Timeout

BROKER = MANIFESTS / "broker"
BROKER_EXAMPLES = BROKER / "examples"
BROKER_SELECTOR = "app.kubernetes.io/component=mount-broker"
LEVEL_LABEL = "pod-security.kubernetes.io/enforce"
CAP_SYS_ADMIN_BIT = 21
MOUNTPOINT = "/mnt/remote"


def _broker_host_paths() -> dict[str, Path]:
    """The broker DaemonSet's hostPaths by volume name: `broker` (socket and shim, the
    plugin's broker dir) and `state` (its records)."""
    for doc in yaml.safe_load_all((BROKER / "broker-daemonset.yaml").read_text()):
        if doc and doc["kind"] == "DaemonSet":
            return {v["name"]: Path(v["hostPath"]["path"])
                    for v in doc["spec"]["template"]["spec"]["volumes"]}
    raise LookupError("no DaemonSet in broker-daemonset.yaml")


HOST_PATHS = _broker_host_paths()
BROKER_DIR, STATE_DIR = HOST_PATHS["broker"], HOST_PATHS["state"]
SHIM = BROKER_DIR / protocol.SHIM_NAME


# ---------------------------------------------------------------- the examples


def _docs(name: str) -> list[dict[str, Any]]:
    """The documents of one shipped file of manifests/broker/examples/."""
    return [d for d in yaml.safe_load_all((BROKER_EXAMPLES / name).read_text()) if d]


@dataclass(frozen=True)
class Example:
    """One of manifests/broker/examples/: its file, its namespace's file and the image
    (a key of images.env) that stands in for its tool image."""

    file: str
    namespace_file: str
    image_key: str

    def doc(self, kind: str) -> dict[str, Any]:
        """The example's one object of that kind, as shipped."""
        [found] = [d for d in _docs(self.file) if d["kind"] == kind]
        return found

    @property
    def pod(self) -> dict[str, Any]:
        return self.doc("Pod")

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def level(self) -> str:
        [ns] = _docs(self.namespace_file)
        assert ns["metadata"]["name"] == self.namespace, ns
        return str(ns["metadata"]["labels"][LEVEL_LABEL])

    def overlay(self, tmp: Path, servers: Servers, images: dict[str, str]) -> Path:
        """The example and its namespace, with test_cluster.py's substitutions: the tool
        image named, the key and the server's host key line in the Secret, REMOTE."""
        dst = tmp / Path(self.file).stem
        dst.mkdir(parents=True)
        for f in (self.namespace_file, self.file):
            shutil.copy(BROKER_EXAMPLES / f, dst / f)
        container = self.pod["spec"]["containers"][0]
        secret = self.doc("Secret")["metadata"]
        name, _, tag = images[self.image_key].rpartition(":")
        write_json(dst / "kustomization.yaml", {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [self.namespace_file, self.file],
            "images": [{"name": container["image"], "newName": name, "newTag": tag}],
            "patches": [{"patch": json.dumps(p)} for p in [
                {"apiVersion": "v1", "kind": "Secret", "metadata": secret,
                 "stringData": {"id_ed25519": servers.client_key,
                                "known_hosts": f"{servers.sshd_ip} {servers.host_key_pub}\n"}},
                {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": self.name, "namespace": self.namespace},
                 "spec": {"containers": [{"name": container["name"], "env": [
                     {"name": "REMOTE", "value": f"root@{servers.sshd_ip}:/srv/data"}]}]}},
            ]],
        })
        return dst

    def apply(self, kubectl: Kubectl, tmp: Path, servers: Servers,
              images: dict[str, str]) -> None:
        """`kubectl apply -k` of the overlay, as a user applies the example."""
        kubectl(*APPLY, "-k", str(self.overlay(tmp, servers, images)))

    def delete(self, kubectl: Kubectl, api: Api) -> None:
        """The pod (waited for until gone) and its Secret; the namespace stays."""
        delete_pod(kubectl, api, self.namespace, self.name)
        kubectl("-n", self.namespace, "delete", "secret", self.doc("Secret")["metadata"]["name"],
                "--ignore-not-found")

    def sh(self, kubectl: Kubectl, script: str) -> str:
        """A shell script run in the example's container; its output, stderr included."""
        return exec_in(kubectl, self.namespace, self.name, script)


BASELINE = Example("sshfs-pod.yaml", "namespace.yaml", "EXAMPLE_SSHFS_IMAGE")
RESTRICTED = Example("sshfs-restricted-pod.yaml", "namespace-restricted.yaml",
                     "EXAMPLE_SSHFS_NONROOT_IMAGE")
USERNS_FILE = "sshfs-userns-pod.yaml"


# ---------------------------------------------------------------- helpers


def edit_add_component(kustomization_dir: Path, component: str) -> None:
    """What `kustomize edit add component COMPONENT` does: check that the component is
    there and append it to `components:` (kustomize v5)."""
    assert (kustomization_dir / component / "kustomization.yaml").is_file(), component
    path = kustomization_dir / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    components = kustomization.setdefault("components", [])
    if component not in components:
        components.append(component)
    write_json(path, kustomization)


def pod_log(kubectl: Kubectl, namespace: str, name: str) -> str:
    """A container's log; empty while the kubelet cannot serve it yet."""
    return kubectl.run("-n", namespace, "logs", name, check=False).stdout


def lines_with(text: str, *words: str) -> list[str]:
    """The log lines holding every word: the evidence a test quotes."""
    return [ln for ln in text.splitlines() if all(w in ln for w in words)]


def component_logs(kubectl: Kubectl, api: Api) -> str:
    """The last lines of every plugin and broker pod's log, for failure messages."""
    out = []
    for selector in (PLUGIN_SELECTOR, BROKER_SELECTOR):
        for p in api.pods(PLUGIN_NS, selector):
            name = p["metadata"]["name"]
            log = pod_log(kubectl, PLUGIN_NS, name).splitlines()[-25:]
            out.append(f"--- {pod_summary(p)}\n" + "\n".join(log))
    return "\n".join(out) or f"no plugin or broker pods in {PLUGIN_NS}"


def broker_pod(api: Api, not_uid: str | None = None) -> dict[str, Any]:
    """The broker DaemonSet's one Ready pod (not the one with uid not_uid: after a
    restart, its successor)."""
    return daemonset_pod(api, PLUGIN_NS, BROKER_SELECTOR, not_uid=not_uid)


def broker_lines(kubectl: Kubectl, api: Api, event: str, pod_uid: str) -> list[str]:
    """The current broker's log lines of one event for one pod (the caller's cgroup
    names the pod's uid)."""
    name = broker_pod(api)["metadata"]["name"]
    return lines_with(pod_log(kubectl, PLUGIN_NS, name), f" {event} ", pod_uid)


def health_lines(kubectl: Kubectl, api: Api) -> list[str]:
    """The plugin's health as it logged it: at start, and at every change."""
    plugin = [p for p in api.pods(PLUGIN_NS, PLUGIN_SELECTOR)
              if "deletionTimestamp" not in p["metadata"]]
    log = pod_log(kubectl, PLUGIN_NS, plugin[0]["metadata"]["name"]) if plugin else ""
    return [ln for ln in log.splitlines()
            if re.search(r" (start|device\.health) .*health=", ln)]


def fresh_node(kubectl: Kubectl, api: Api, overlay: Path) -> str:
    """A node that never ran broker mode: everything of ours deleted through the API, then
    the broker's host directories removed. Returns what was removed."""
    kubectl("delete", "-k", str(overlay), "--ignore-not-found", "--wait=true", timeout=240)
    wait_for(lambda: not api.pods(PLUGIN_NS), 120, "the plugin and broker pods to be gone",
             interval=0.5)
    removed = [str(d) for d in (BROKER_DIR, STATE_DIR) if d.exists()]
    for d in (BROKER_DIR, STATE_DIR):
        shutil.rmtree(d, ignore_errors=True)
    return f"fresh node: removed {removed or 'nothing'}; {BROKER_DIR} exists={BROKER_DIR.exists()}"


def wait_example_mounted(kubectl: Kubectl, api: Api, example: Example) -> str:
    """The example's sshfs mount, waited for; on a timeout the plugin's and the broker's
    logs join the pod's, since the broker's refusal is logged there."""
    try:
        return wait_mounted(kubectl, api, example.name, MOUNTPOINT, "fuse.sshfs",
                            namespace=example.namespace)
    except Timeout as exc:
        raise Timeout(f"{exc}\n{component_logs(kubectl, api)}") from None


def round_trip(kubectl: Kubectl, example: Example, mountpoint: str, tag: str) -> tuple[str, str]:
    """Data both ways through the pod's mount at mountpoint, whose remote is the sshd
    pod's /srv/data: (server -> pod, pod -> server), each expected to be tag-token."""
    token = f"{tag}-{uuid.uuid4().hex[:12]}"
    exec_in(kubectl, SERVERS_NS, "sshd", f"echo from-server-{token} > /srv/data/in-{tag}.txt")
    read = example.sh(kubectl, f"cat {mountpoint}/in-{tag}.txt")
    example.sh(kubectl, f"echo from-pod-{token} > {mountpoint}/out-{tag}.txt")
    back = exec_in(kubectl, SERVERS_NS, "sshd", f"cat /srv/data/out-{tag}.txt")
    assert read == f"from-server-{token}", f"server -> pod through {mountpoint}: {read}"
    assert back == f"from-pod-{token}", f"pod -> server through {mountpoint}: {back}"
    return f"server -> pod: {read}", f"pod -> server: {back}"


def fuse_line(kubectl: Kubectl, example: Example, mountpoint: str) -> str:
    """The container's mountinfo line of the FUSE mount at mountpoint ("" if none)."""
    out = example.sh(kubectl, f"grep ' {mountpoint} ' /proc/self/mountinfo")
    return next((ln for ln in out.splitlines() if " fuse." in ln), "")


def unmount(kubectl: Kubectl, example: Example, mountpoint: str) -> str:
    """`fusermount3 -u` in the pod (the shim, then the broker); its exit status."""
    return example.sh(kubectl, f"fusermount3 -u {mountpoint}; echo fusermount3 -u rc=$?")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def broker_overlay(tmp_path_factory: pytest.TempPathFactory, images: dict[str, str]) -> Path:
    """README "Broker mode", Deploy: in a copy of manifests/ with the README's image
    (`kustomize edit set image`), `kustomize edit add component broker`."""
    overlay = manifests_overlay(tmp_path_factory.mktemp("broker-overlay"),
                                images["PLUGIN_IMAGE"])
    edit_add_component(overlay, "broker")
    return overlay


@pytest.fixture
def broker_deployed(cluster: Cluster, kubectl: Kubectl, api: Api,
                    broker_overlay: Path) -> dict[str, Any]:
    """The manifests with the broker component applied (a no-op when they are there),
    every DaemonSet rolled out, the slots healthy; returns the broker's Ready pod."""
    kubectl(*APPLY, "-k", str(broker_overlay))
    for ds in (BROKER_DS, PLUGIN_DS, INSTALLER_DS):
        rollout(kubectl, ds)
    wait_allocatable(api, DEFAULT_SLOTS)
    return broker_pod(api)


@pytest.fixture
def baseline_pod(*, broker_deployed: dict[str, Any], servers: Servers, kubectl: Kubectl,
                 api: Api, images: dict[str, str], tmp_path: Path) -> Iterator[dict[str, Any]]:
    """manifests/broker/examples/sshfs-pod.yaml Running with its sshfs mount."""
    BASELINE.apply(kubectl, tmp_path, servers, images)
    try:
        wait_example_mounted(kubectl, api, BASELINE)
        [pod] = [p for p in api.pods(BASELINE.namespace) if p["metadata"]["name"] == BASELINE.name]
        yield pod
    finally:
        BASELINE.delete(kubectl, api)


# ---------------------------------------------------------------- 1. deploy


def test_broker_component_on_a_fresh_node_as_the_readme_says(
    cluster: Cluster, kubectl: Kubectl, api: Api, broker_overlay: Path
) -> None:
    """README "Broker mode", Deploy, on a node without the broker's directories: `kubectl
    apply -k` of manifests/ with the component added. The broker turns Ready through its
    own probes, installs its shim as a regular file (the image's, byte for byte), and
    the plugin reports its slots healthy with the shim, never without it."""
    fresh = fresh_node(kubectl, api, broker_overlay)
    applied = kubectl(*APPLY, "-k", str(broker_overlay)).strip().splitlines()
    rolled = [rollout(kubectl, ds) for ds in (BROKER_DS, PLUGIN_DS, INSTALLER_DS)]
    broker = broker_pod(api)
    name = broker["metadata"]["name"]
    container = broker["spec"]["containers"][0]
    status = broker["status"]["containerStatuses"][0]
    line = wait_allocatable(api, DEFAULT_SLOTS)
    st = SHIM.lstat()
    on_host = hashlib.sha256(SHIM.read_bytes()).hexdigest()
    in_image = exec_in(kubectl, PLUGIN_NS, name, f"sha256sum {settings.DEFAULT_SHIM}").split()[0]
    healths = health_lines(kubectl, api)
    serving = lines_with(pod_log(kubectl, PLUGIN_NS, name), " broker.serving ")
    probes = {kind: (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
              for kind in ("readinessProbe", "livenessProbe")}
    proof = evidence(
        "broker-deploy", fresh, *applied, *rolled, pod_summary(broker),
        f"probes {probes}; container ready={status['ready']} image={status['image']}",
        *serving,
        f"{SHIM}: {stat.filemode(st.st_mode)} sha256 {on_host[:16]}; "
        f"{settings.DEFAULT_SHIM} in the image: {in_image[:16]}",
        *healths, line,
    ) + "\n" + component_logs(kubectl, api)
    assert status["ready"], proof
    assert pod_ready(broker), proof
    assert probes == {"readinessProbe": ("/readyz", "metrics"),
                      "livenessProbe": ("/healthz", "metrics")}, proof
    assert serving, proof
    assert stat.S_ISREG(st.st_mode), proof
    assert on_host == in_image, proof
    assert healths, proof
    assert "health=Healthy" in healths[-1], proof
    for ln in healths:  # Healthy always with the shim; Unhealthy only for its lack
        healthy = "health=Healthy" in ln
        assert healthy == ("shim is installed" in ln), f"{ln}\n{proof}"
        assert healthy or "broker mode:" in ln, f"{ln}\n{proof}"


# ---------------------------------------------------------------- 2. the baseline example


def test_one_line_pod_at_baseline_mounts_sshfs_through_the_broker(
    baseline_pod: dict[str, Any], kubectl: Kubectl, api: Api
) -> None:
    """manifests/broker/examples/sshfs-pod.yaml (only `github.com/fuse: 1`, RuntimeDefault
    seccomp, no capability) in its `baseline` namespace: sshfs mounts through the shim and
    the broker, data moves both ways, and `fusermount3 -u` unmounts it."""
    uid = baseline_pod["metadata"]["uid"]
    violations = baseline_violations(BASELINE.pod)
    stored = baseline_pod["spec"]["containers"][0]
    mounted = fuse_line(kubectl, BASELINE, MOUNTPOINT)
    data = round_trip(kubectl, BASELINE, MOUNTPOINT, "baseline")
    status = BASELINE.sh(kubectl, "id; grep -E '^(CapEff|NoNewPrivs):' /proc/self/status")
    profile, mode = seccomp_seen(kubectl, api, BASELINE.name, BASELINE.namespace)
    mounts = broker_lines(kubectl, api, "broker.mount", uid)
    gone = unmount(kubectl, BASELINE, MOUNTPOINT)
    after = fuse_line(kubectl, BASELINE, MOUNTPOINT)
    unmounts = broker_lines(kubectl, api, "broker.unmount", uid)
    proof = evidence(
        "broker-baseline",
        f"namespace {BASELINE.namespace}: {LEVEL_LABEL}={BASELINE.level}; the example "
        f"against the baseline rules: {violations or 'no violation'}",
        f"stored container: limits {stored['resources']['limits']}, "
        f"securityContext {stored.get('securityContext')}",
        f"mountinfo: {mounted}", *data, *status.splitlines(),
        f"seccompProfile {profile}; {mode}", *mounts, gone,
        f"after: {after or f'no FUSE mount at {MOUNTPOINT}'}", *unmounts,
    ) + "\n" + component_logs(kubectl, api)
    assert BASELINE.level == "baseline", proof
    assert violations == [], proof
    assert [k for k in stored["resources"]["limits"] if "fuse" in k] == [RESOURCE], proof
    assert "capabilities" not in stored["securityContext"], proof
    assert "fuse.sshfs" in mounted, proof
    assert "user_id=0" in mounted, proof
    assert "nosuid" in mounted.split()[5], proof
    assert "nodev" in mounted.split()[5], proof
    cap_eff = int(re.search(r"CapEff:\s+(\w+)", status)[1], 16)  # type: ignore[index]
    assert not cap_eff >> CAP_SYS_ADMIN_BIT & 1, proof
    assert profile == {"type": "RuntimeDefault"}, proof
    assert re.search(r"Seccomp:\s+2", mode), proof
    assert len(mounts) == 1, proof
    assert f"path={MOUNTPOINT}" in mounts[0], proof
    assert "rc=0" in gone, proof
    assert after == "", proof
    assert len(unmounts) == 1, proof
    assert f"path={MOUNTPOINT}" in unmounts[0], proof


# ---------------------------------------------------------------- 3. broker restarts

SECOND = "/srv"  # a directory of the example's image: a second mount while one is up


def mount_second(kubectl: Kubectl, example: Example) -> str:
    """A new sshfs mount in the running pod, as its command makes the first one. Its
    output goes to /dev/shm (the root filesystem is read-only), not to the exec stream,
    which the backgrounded ssh would otherwise hold open."""
    return example.sh(
        kubectl,
        f'sshfs "$REMOTE" {SECOND} -o IdentityFile=/etc/sshfs/id_ed25519 '
        "-o UserKnownHostsFile=/etc/sshfs/known_hosts </dev/null >/dev/null "
        "2>/dev/shm/sshfs.err; echo sshfs rc=$?; cat /dev/shm/sshfs.err")


@pytest.mark.parametrize("how", ["delete-pod", "rollout-restart"])
def test_broker_restart_keeps_a_mount_and_serves_new_ones(
    how: str, baseline_pod: dict[str, Any], kubectl: Kubectl, api: Api
) -> None:
    """The broker pod deleted (`kubectl delete pod`) or rolled (`kubectl rollout restart
    ds/fuse-mount-broker`): the mount made through the old broker keeps moving data both
    ways, and a new mount through the new broker works and unmounts."""
    old = broker_pod(api)
    if how == "delete-pod":
        did = kubectl("-n", PLUGIN_NS, "delete", "pod", old["metadata"]["name"],
                      "--wait=true").strip()
    else:
        did = kubectl("-n", PLUGIN_NS, "rollout", "restart", f"daemonset/{BROKER_DS}").strip()
        did += "; " + rollout(kubectl, BROKER_DS)
    new = broker_pod(api, not_uid=old["metadata"]["uid"])
    kept = fuse_line(kubectl, BASELINE, MOUNTPOINT)
    existing = round_trip(kubectl, BASELINE, MOUNTPOINT, f"{how}-existing")
    second = mount_second(kubectl, BASELINE)
    line = fuse_line(kubectl, BASELINE, SECOND)
    fresh = round_trip(kubectl, BASELINE, SECOND, f"{how}-new") if line else ("", "")
    gone = unmount(kubectl, BASELINE, SECOND)
    after = fuse_line(kubectl, BASELINE, SECOND)
    uid = baseline_pod["metadata"]["uid"]
    mounts = broker_lines(kubectl, api, "broker.mount", uid)
    unmounts = broker_lines(kubectl, api, "broker.unmount", uid)
    proof = evidence(
        f"broker-{how}", did, f"old broker {old['metadata']['name']} -> new "
        + pod_summary(new), f"existing mount: {kept}", *existing,
        second, f"new mount: {line}", *fresh, gone, *mounts, *unmounts,
    ) + "\n" + component_logs(kubectl, api)
    assert new["metadata"]["uid"] != old["metadata"]["uid"], proof
    assert "fuse.sshfs" in kept, proof
    assert "sshfs rc=0" in second, proof
    assert "fuse.sshfs" in line, proof
    assert "rc=0" in gone, proof
    assert after == "", proof
    # The new broker made and removed the second mount, and nothing else for this pod:
    # the first mount needed no broker to keep working.
    assert len(mounts) == 1, proof
    assert f"path={SECOND}" in mounts[0], proof
    assert len(unmounts) == 1, proof
    assert f"path={SECOND}" in unmounts[0], proof


# ---------------------------------------------------------------- 4. a poisoned node


def daemonset_pod_any(api: Api, selector: str) -> dict[str, Any]:
    """The DaemonSet's one live pod, Ready or not."""
    def seen() -> dict[str, Any] | None:
        pods = [p for p in api.pods(PLUGIN_NS, selector)
                if "deletionTimestamp" not in p["metadata"]]
        return pods[0] if len(pods) == 1 else None

    pod: dict[str, Any] = wait_for(seen, 60, f"one pod of {selector}", interval=0.5)
    return pod


def pod_events(api: Api, pod: dict[str, Any]) -> str:
    """The events of this pod (not of earlier pods of the same name), one a line."""
    md = pod["metadata"]
    return "\n".join(f"  {e.get('type')} {e.get('reason')}: {e.get('message')}"
                     for e in api.events(md["namespace"], md["name"])
                     if e["involvedObject"].get("uid") == md["uid"])


def api_pod(api: Api, pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API has it now."""
    md = pod["metadata"]
    found: dict[str, Any] = api.get(f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}")
    return found


def test_node_poisoned_by_a_directory_recovers_once_the_broker_runs(
    *, cluster: Cluster, kubectl: Kubectl, api: Api, broker_overlay: Path, servers: Servers,
    images: dict[str, str], tmp_path: Path
) -> None:
    """A node where the shim's path was once created as a directory (what the runtime
    does at a missing bind source), and the plugin in broker mode deployed before the
    broker: the slots are unhealthy (allocatable 0), so a FUSE pod stays Pending with
    `Insufficient github.com/fuse` and cannot start on the bad bind. `kubectl apply -k`
    with the broker: it replaces the directory with its shim, the slots come back, and the
    Pending pod starts and mounts."""
    fresh = fresh_node(kubectl, api, broker_overlay)
    SHIM.mkdir(parents=True)
    objects = [d for d in yaml.safe_load_all(kubectl("kustomize", str(broker_overlay))) if d]
    without = [d for d in objects
               if not (d["kind"] == "DaemonSet" and d["metadata"]["name"] == BROKER_DS)]
    assert len(without) == len(objects) - 1
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": without}))
    try:
        unhealthy = wait_for(
            lambda: [ln for ln in health_lines(kubectl, api) if "not a regular file" in ln],
            120, "the plugin to say the shim is not a regular file", interval=1,
            detail=lambda: component_logs(kubectl, api))
        plugin = daemonset_pod_any(api, PLUGIN_SELECTOR)
        registered = wait_for(
            lambda: lines_with(pod_log(kubectl, PLUGIN_NS, plugin["metadata"]["name"]),
                               " registered "),
            60, "the plugin to register", detail=lambda: component_logs(kubectl, api))

        def zero() -> str | None:
            cap, alloc = fuse_resources(api)
            return f"node: capacity {RESOURCE}={cap} allocatable={alloc}" \
                if cap == DEFAULT_SLOTS and alloc == 0 else None

        node = wait_for(zero, 90, f"allocatable {RESOURCE} 0 of {DEFAULT_SLOTS}", interval=0.5,
                        detail=lambda: f"node reports {fuse_resources(api)}")
        BASELINE.apply(kubectl, tmp_path, servers, images)

        def insufficient(p: dict[str, Any]) -> bool:
            return p["status"].get("phase") == "Pending" and "Insufficient github.com/fuse" \
                in pod_events(api, p)

        pending = wait_pod(api, BASELINE.namespace, BASELINE.name, insufficient,
                           "Pending for lack of github.com/fuse")
        why = pod_events(api, pending)
        still = f"{SHIM}: directory={SHIM.is_dir()}"
        proof = evidence(
            "broker-poisoned", fresh, f"mkdir {SHIM}; applied every object but the broker",
            *unhealthy[-1:], *registered, pod_summary(api_pod(api, plugin)), node,
            pod_summary(pending), why, still,
        )
        assert SHIM.is_dir(), proof
        assert not pod_ready(api_pod(api, plugin)), proof
        assert not pending["status"].get("containerStatuses"), proof
        assert "Insufficient github.com/fuse" in why, proof

        applied = kubectl(*APPLY, "-k", str(broker_overlay)).strip().splitlines()
        rolled = [rollout(kubectl, ds) for ds in (BROKER_DS, PLUGIN_DS)]
        line = wait_allocatable(api, DEFAULT_SLOTS)
        st = SHIM.lstat()
        mounted = wait_example_mounted(kubectl, api, BASELINE)
        data = round_trip(kubectl, BASELINE, MOUNTPOINT, "recovered")
        healths = health_lines(kubectl, api)
        proof = evidence(
            "broker-poisoned", *[a for a in applied if BROKER_DS in a], *rolled,
            f"{SHIM}: {stat.filemode(st.st_mode)}", *healths[-1:], line,
            f"the Pending pod started: {mounted}", *data,
        ) + "\n" + component_logs(kubectl, api)
        assert stat.S_ISREG(st.st_mode), proof
        assert "health=Healthy" in healths[-1], proof
    finally:
        BASELINE.delete(kubectl, api)


# ---------------------------------------------------------------- 5. restricted, uid 1000


def test_restricted_example_mounts_sshfs_as_uid_1000(
    *, broker_deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    images: dict[str, str], tmp_path: Path
) -> None:
    """manifests/broker/examples/sshfs-restricted-pod.yaml in its `restricted` namespace:
    uid 1000 with the complete restricted security context mounts sshfs through the
    broker (user_id=1000), moves data both ways, sees the files as its own, and
    unmounts with `fusermount3 -u`."""
    violations = restricted_violations(RESTRICTED.pod)
    RESTRICTED.apply(kubectl, tmp_path, servers, images)
    try:
        wait_example_mounted(kubectl, api, RESTRICTED)
        [pod] = [p for p in api.pods(RESTRICTED.namespace)
                 if p["metadata"]["name"] == RESTRICTED.name]
        uid = pod["metadata"]["uid"]
        context = pod["spec"]["containers"][0]["securityContext"]
        mounted = fuse_line(kubectl, RESTRICTED, MOUNTPOINT)
        data = round_trip(kubectl, RESTRICTED, MOUNTPOINT, "restricted")
        owners = RESTRICTED.sh(kubectl, f"stat -c '%u:%g %n' {MOUNTPOINT}/*-restricted.txt")
        status = RESTRICTED.sh(
            kubectl, "id; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; "
            "touch /rootfs-write 2>&1; echo root filesystem write rc=$?")
        mounts = broker_lines(kubectl, api, "broker.mount", uid)
        gone = unmount(kubectl, RESTRICTED, MOUNTPOINT)
        after = fuse_line(kubectl, RESTRICTED, MOUNTPOINT)
        unmounts = broker_lines(kubectl, api, "broker.unmount", uid)
        proof = evidence(
            "broker-restricted",
            f"namespace {RESTRICTED.namespace}: {LEVEL_LABEL}={RESTRICTED.level}; the "
            f"example against the restricted rules: {violations or 'no violation'}",
            f"stored securityContext {context}", f"mountinfo: {mounted}", *data,
            *owners.splitlines(), *status.splitlines(), *mounts, gone,
            f"after: {after or f'no FUSE mount at {MOUNTPOINT}'}", *unmounts,
        ) + "\n" + component_logs(kubectl, api)
        assert RESTRICTED.level == "restricted", proof
        assert violations == [], proof
        assert "uid=1000" in status, proof
        assert "gid=1000" in status, proof
        assert re.search(r"CapEff:\s+0+$", status, re.M), proof
        assert re.search(r"NoNewPrivs:\s+1$", status, re.M), proof
        assert re.search(r"Seccomp:\s+2$", status, re.M), proof
        assert "Read-only file system" in status, proof
        assert "fuse.sshfs" in mounted, proof
        assert "user_id=1000" in mounted, proof
        assert [ln.split()[0] for ln in owners.splitlines()] == ["1000:1000", "1000:1000"], proof
        assert len(mounts) == 1, proof
        assert "uid=1000" in mounts[0], proof
        assert "rc=0" in gone, proof
        assert after == "", proof
        assert len(unmounts) == 1, proof
        assert "uid=1000" in unmounts[0], proof
    finally:
        RESTRICTED.delete(kubectl, api)


# ---------------------------------------------------------------- 6. hostUsers: false


USERNS = Example(USERNS_FILE, "namespace-restricted.yaml", "EXAMPLE_SSHFS_NONROOT_IMAGE")
# The same pod as the user namespace's root, in the baseline namespace (restricted asks
# for runAsNonRoot; whether a user-namespaced pod is excused is a Pod Security option).
USERNS_ROOT_NAME = "sshfs-userns-root"
USERNS_ROOT_CONTEXT = {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False}
# ssh ignores a key that its owner's group may read ("UNPROTECTED PRIVATE KEY FILE",
# then "Permission denied (publickey)"): as root the key must be 0400 and the pod without
# the example's fsGroup, with which the kubelet makes the Secret's files group-readable
# (that is how uid 1000 reads it).
USERNS_ROOT_KEY_MODE = 0o400


def userns_overlay(tmp: Path, servers: Servers, images: dict[str, str],
                   as_root: bool) -> tuple[Path, str, str]:
    """manifests/broker/examples/sshfs-userns-pod.yaml as its comment tells a user to apply
    it (after sshfs-restricted-pod.yaml, whose Secret it uses), filled in as the other
    examples are; as_root: the variant run as the namespace's root. Returns the overlay,
    the pod's namespace and name."""
    dst = tmp / ("userns-root" if as_root else "userns")
    dst.mkdir(parents=True)
    pod = USERNS.pod
    namespace = BASELINE.namespace if as_root else USERNS.namespace
    name = USERNS_ROOT_NAME if as_root else USERNS.name
    secret = RESTRICTED.doc("Secret") | {"metadata": {
        **RESTRICTED.doc("Secret")["metadata"], "namespace": namespace}}
    container = pod["spec"]["containers"][0]
    write_json(dst / "secret.json", secret)
    shutil.copy(BROKER_EXAMPLES / USERNS_FILE, dst / USERNS_FILE)
    edits: list[dict[str, Any]] = [{"op": "add", "path": "/spec/containers/0/env/0/value",
                                    "value": f"root@{servers.sshd_ip}:/srv/data"}]
    if as_root:
        edits += [{"op": "replace", "path": "/metadata/name", "value": name},
                  {"op": "replace", "path": "/metadata/namespace", "value": namespace},
                  *({"op": "replace", "path": f"/spec/containers/0/securityContext/{k}",
                     "value": v} for k, v in USERNS_ROOT_CONTEXT.items()),
                  {"op": "replace", "path": "/spec/volumes/0/secret/defaultMode",
                   "value": USERNS_ROOT_KEY_MODE},
                  {"op": "remove", "path": "/spec/securityContext/fsGroup"}]
    name_, _, tag = images[USERNS.image_key].rpartition(":")
    write_json(dst / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["secret.json", USERNS_FILE],
        "images": [{"name": container["image"], "newName": name_, "newTag": tag}],
        "patches": [
            {"patch": json.dumps({"apiVersion": "v1", "kind": "Secret",
                                  "metadata": secret["metadata"],
                                  "stringData": {"id_ed25519": servers.client_key,
                                                 "known_hosts": f"{servers.sshd_ip} "
                                                 f"{servers.host_key_pub}\n"}})},
            {"target": {"kind": "Pod", "name": USERNS.name}, "patch": json.dumps(edits)},
        ],
    })
    return dst, namespace, name


@pytest.mark.parametrize("as_root", [False, True], ids=["uid-1000", "pod-root"])
def test_userns_example_mounts_through_the_broker(
    *, broker_deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    images: dict[str, str], tmp_path: Path, as_root: bool
) -> None:
    """manifests/broker/examples/sshfs-userns-pod.yaml (`hostUsers: false`) admitted in its
    `restricted` namespace, and its variant as the user namespace's root in the `baseline`
    one: the pod runs in a user namespace of its own (uid_map 0 -> an unprivileged range
    of the node), the broker enters it and mounts as the caller, data moves both ways,
    the files and the mount's owner are the caller's as the pod sees them, and
    `fusermount3 -u` unmounts."""
    for f in (RESTRICTED.namespace_file, BASELINE.namespace_file):
        kubectl(*APPLY, "-f", str(BROKER_EXAMPLES / f))
    overlay, namespace, name = userns_overlay(tmp_path, servers, images, as_root)
    kubectl(*APPLY, "-k", str(overlay))
    uid = 0 if as_root else 1000
    try:
        try:
            mounted = wait_mounted(kubectl, api, name, MOUNTPOINT, "fuse.sshfs",
                                   namespace=namespace)
        except Timeout as exc:
            raise Timeout(f"{exc}\n{component_logs(kubectl, api)}") from None
        [pod] = [p for p in api.pods(namespace) if p["metadata"]["name"] == name]

        def sh(script: str) -> str:
            return exec_in(kubectl, namespace, name, script)

        level = yaml.safe_load(kubectl("get", "namespace", namespace, "-o", "yaml"))[
            "metadata"]["labels"][LEVEL_LABEL]
        uid_map = sh("cat /proc/self/uid_map").split()
        ident = sh("id -u; id -g")
        line = next((ln for ln in sh(f"grep ' {MOUNTPOINT} ' /proc/self/mountinfo")
                     .splitlines() if " fuse." in ln), "")
        token = uuid.uuid4().hex[:12]
        exec_in(kubectl, SERVERS_NS, "sshd", f"echo in-{token} > /srv/data/userns-in.txt")
        read = sh(f"cat {MOUNTPOINT}/userns-in.txt")
        sh(f"echo out-{token} > {MOUNTPOINT}/userns-out.txt")
        back = exec_in(kubectl, SERVERS_NS, "sshd", "cat /srv/data/userns-out.txt")
        owners = sh(f"stat -c '%u:%g' {MOUNTPOINT}/userns-in.txt {MOUNTPOINT}/userns-out.txt")
        mounts = broker_lines(kubectl, api, "broker.mount", pod["metadata"]["uid"])
        gone = sh(f"fusermount3 -u {MOUNTPOINT}; echo fusermount3 -u rc=$?")
        restarts = [c.get("restartCount") for c in (api_pod(api, pod)["status"]
                                                     .get("containerStatuses") or [])]
        earlier = kubectl.run("-n", namespace, "logs", name, "--previous", check=False)
        proof = evidence(
            f"broker-userns-{'root' if as_root else 'uid-1000'}",
            f"namespace {namespace}: {LEVEL_LABEL}={level}", pod_summary(pod),
            f"stored hostUsers={pod['spec'].get('hostUsers')}",
            f"uid_map {' '.join(uid_map)}; id -u, -g: {ident.split()}", mounted,
            f"mountinfo: {line}", f"server -> pod: {read}", f"pod -> server: {back}",
            f"owners as the pod sees them: {owners.split()}", *mounts, gone,
            f"restarts {restarts}; the previous container's log: "
            f"{(earlier.stdout + earlier.stderr).strip()}",
        ) + "\n" + component_logs(kubectl, api)
        assert level == ("baseline" if as_root else "restricted"), proof
        assert pod["spec"].get("hostUsers") is False, proof
        assert (uid_map[0], uid_map[2]) == ("0", "65536"), proof
        assert int(uid_map[1]) >= 65536, proof
        assert ident.split() == [str(uid), str(uid)], proof
        assert f"user_id={uid}" in line, proof
        assert read == f"in-{token}", proof
        assert back == f"out-{token}", proof
        assert owners.split() == [f"{uid}:{uid}"] * 2, proof
        assert restarts == [0], proof
        assert len(mounts) == 1, proof
        assert "rc=0" in gone, proof
    finally:
        delete_pod(kubectl, api, namespace, name)


# ---------------------------------------------------------------- 7. a rootless image build

BUILDAH_FILE = "buildah-userns-pod.yaml"
BUILDAH_POD = "buildah-userns-example"


def buildah_overlay(tmp: Path, images: dict[str, str], capabilities: bool) -> Path:
    """manifests/broker/examples/buildah-userns-pod.yaml with its tool image named; without
    `capabilities`, the variant with every capability dropped (what `restricted` allows)."""
    dst = tmp / f"buildah-{'caps' if capabilities else 'nocaps'}"
    dst.mkdir(parents=True)
    shutil.copy(BROKER_EXAMPLES / BUILDAH_FILE, dst / BUILDAH_FILE)
    name, _, tag = images["EXAMPLE_BUILDAH_IMAGE"].rpartition(":")
    patches = [] if capabilities else [{
        "target": {"kind": "Pod", "name": BUILDAH_POD}, "patch": json.dumps(
            [{"op": "remove", "path": "/spec/containers/0/securityContext/capabilities/add"}])}]
    write_json(dst / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [BUILDAH_FILE],
        "images": [{"name": "fuse-example-buildah", "newName": name, "newTag": tag}],
        "patches": patches})
    return dst


@pytest.mark.parametrize("capabilities", [True, False], ids=["buildah-build", "no-capability"])
def test_rootless_image_build_with_buildah_through_the_broker(
    *, broker_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str],
    tmp_path: Path, capabilities: bool
) -> None:
    """The seed's workload: manifests/broker/examples/buildah-userns-pod.yaml, an image
    build in a `hostUsers: false` pod whose only FUSE line is `github.com/fuse: 1`, in its
    `baseline` namespace. buildah's overlay storage is mounted by fuse-overlayfs through the
    shim and the broker; the pod builds FROM scratch (with `buildah build` where it holds
    the namespaced SYS_CHROOT and DAC_OVERRIDE; by buildah's own steps with no capability
    at all), mounts the result, and writes it as an OCI archive whose layer holds the
    file."""
    namespace = BASELINE.namespace
    kubectl(*APPLY, "-f", str(BROKER_EXAMPLES / BASELINE.namespace_file))
    kubectl(*APPLY, "-k", str(buildah_overlay(tmp_path, images, capabilities)))
    try:
        def pushed() -> str | None:
            out = pod_log(kubectl, namespace, BUILDAH_POD)
            return out if "\nPUSHED " in f"\n{out}" else None

        out = wait_for(pushed, 300, f"{BUILDAH_POD} to build and push its image", interval=2,
                       detail=lambda: pod_log(kubectl, namespace, BUILDAH_POD)[-3000:] + "\n"
                       + component_logs(kubectl, api))
        [pod] = [p for p in api.pods(namespace) if p["metadata"]["name"] == BUILDAH_POD]
        marked = [ln for ln in out.splitlines()
                  if ln.startswith(("VARIANT", "BUILT", "MOUNTED", "PUSHED", "LAYER"))]
        mounted = [ln for ln in marked if ln.startswith("MOUNTED")]
        layers = [ln for ln in marked if ln.startswith("LAYER")]
        level = yaml.safe_load(kubectl("get", "namespace", namespace, "-o", "yaml"))[
            "metadata"]["labels"][LEVEL_LABEL]
        status = exec_in(kubectl, namespace, BUILDAH_POD,
                         "cat /proc/self/uid_map; id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' "
                         "/proc/self/status")
        mounts = broker_lines(kubectl, api, "broker.mount", pod["metadata"]["uid"])
        proof = evidence(
            f"buildah-{'build' if capabilities else 'no-capability'}",
            f"namespace {namespace}: {LEVEL_LABEL}={level}", pod_summary(pod),
            f"stored hostUsers={pod['spec'].get('hostUsers')}, securityContext "
            f"{pod['spec']['containers'][0]['securityContext']}", *status.splitlines(),
            *marked, f"broker.mount lines for the pod: {len(mounts)}", *mounts[:2],
        ) + "\n" + component_logs(kubectl, api)
        assert level == "baseline", proof
        assert pod["spec"].get("hostUsers") is False, proof
        assert status.split()[:3] != ["0", "0", "4294967295"], proof
        assert mounted, proof
        assert " - fuse.fuse-overlayfs " in mounted[0], proof
        assert any("hello.txt" in ln for ln in layers), proof
        assert marked[0].startswith("VARIANT build" if capabilities else "VARIANT no cap"), proof
        assert mounts, proof
    finally:
        kubectl("-n", namespace, "delete", "configmap", BUILDAH_POD, "--ignore-not-found")
        delete_pod(kubectl, api, namespace, BUILDAH_POD)


def test_a_fuse_pod_sees_no_gpu_in_broker_mode(
    *, broker_deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """As in default mode: the broker component adds binds of its socket and shim, and
    no device beyond /dev/fuse."""
    gpu.prove_isolation(kubectl, api, images["WORKLOAD_IMAGE"], "broker")
