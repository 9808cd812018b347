"""A real cluster on one machine (issue 16): etcd 3.4 and Kubernetes 1.20.2 (API server,
controller manager, scheduler, kubelet joining as a Node) built from Debian's source,
containerd 1.6 + runc, bridge networking; the image built from the project's Dockerfile
with podman; everything deployed with `kubectl apply -k` as the README tells users.

Set-up is tests/cluster/setup.sh (cached under /var/cache/fuse-device-plugin); the cluster
is started and stopped by recorded PID in tests/cluster/cluster.py. Each test sets up what
it needs through fixtures and passes alone. Logs: /var/log/fuse-device-plugin-cluster/
(evidence.txt holds the lines that prove each scenario).

The 1.20 API server predates `securityContext.appArmorProfile` (1.30): kubectl must be told
--validate=false, and the server drops the field (test_old_server_drops_apparmor_profile).
This node's kernel has no AppArmor, so nothing here would enforce it anyway; the AppArmor
halves of the profiles are proven in tests/apparmor_vm.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import gpu, runtime
from tests.cluster.cluster import Api, Cluster, Kubectl, pod_ready
from tests.cluster.kube import (
    APPLY,
    DEFAULT_SLOTS,
    EXAMPLES,
    EXAMPLES_NS,
    INSTALLER_DS,
    INSTALLER_SELECTOR,
    MANIFESTS,
    PLUGIN_DS,
    PLUGIN_NS,
    PLUGIN_SELECTOR,
    RESOURCE,
    SLOTS_ENV,
    PodEverySecond,
    daemonset_pod,
    delete_pod,
    events_text,
    evidence,
    example_doc,
    example_overlay,
    exec_in,
    fuse_pod,
    fuse_resources,
    pod_summary,
    rollout,
    seccomp_seen,
    wait_allocatable,
    wait_gone,
    wait_mounted,
    wait_ready,
    without_apparmor,
    write_json,
)
from tests.cluster.servers import NAMESPACE as SERVERS_NS
from tests.cluster.servers import S3_KEY, S3_SECRET, Servers
from tests.cluster.sshfs_example import (
    SSHFS_FILE,
    apply_sshfs_example,
    delete_sshfs_example,
)
from tests.kubelet.node import SECCOMP_ROOT, wait_for
from tests.lib import oci, profiles, runtimes
from tests.lib import runtime_default as converter

SECCOMP_DIR = SECCOMP_ROOT / "fuse-device-plugin"


def plugin_log(kubectl: Kubectl, pod: str) -> str:
    """The plugin container's log; empty while the kubelet cannot serve it yet (just
    after a kubelet restart the API server relays `NotFound` for a few moments)."""
    return kubectl.run("-n", PLUGIN_NS, "logs", pod, check=False).stdout


def assert_under_preset(profile: dict[str, str], mode: str, preset: str, proof: str) -> None:
    """The stored pod names the preset's Localhost profile and the kernel filters."""
    assert profile == {"type": "Localhost",
                       "localhostProfile": f"fuse-device-plugin/{preset}.json"}, proof
    assert re.search(r"Seccomp:\s+2", mode), proof


# ---------------------------------------------------------------- 1. apply -k


def test_apply_k_plugin_ready_and_node_reports_default_slots(
    cluster: Cluster, kubectl: Kubectl, api: Api, overlay: Path, images: dict[str, str]
) -> None:
    """The README's path from nothing: the shipped kustomization with only its image
    changed, `kubectl apply -k`; the plugin pod turns Ready through its own probes and the
    Node reports the default 1000 slots as capacity and allocatable."""
    kubectl("delete", "-k", str(overlay), "--ignore-not-found", "--wait=true", timeout=180)
    wait_for(lambda: not api.pods(PLUGIN_NS), 90, "the previous plugin pods to be gone")
    applied = kubectl(*APPLY, "-k", str(overlay)).strip().splitlines()
    rolled = [rollout(kubectl, PLUGIN_DS), rollout(kubectl, INSTALLER_DS)]
    pod = daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR)
    c = pod["spec"]["containers"][0]
    status = pod["status"]["containerStatuses"][0]
    probe = c["readinessProbe"]["httpGet"]
    line = wait_allocatable(api, DEFAULT_SLOTS)
    proof = evidence(
        "apply-k", *applied, *rolled, pod_summary(pod),
        f"readinessProbe httpGet {probe['path']} port {probe['port']}, "
        f"livenessProbe httpGet {c['livenessProbe']['httpGet']['path']}; "
        f"container ready={status['ready']} image={status['image']}",
        line,
    )
    assert status["ready"], proof
    assert pod_ready(pod), proof
    assert probe["path"] == "/readyz", proof
    assert status["image"].endswith(images["PLUGIN_IMAGE"].split("/", 1)[1]), proof
    assert " registered " in plugin_log(kubectl, pod["metadata"]["name"]), proof


# ---------------------------------------------------------------- 2. the installer


def test_profile_installer_puts_seccomp_profiles_where_the_kubelet_looks(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api
) -> None:
    """The installer DaemonSet (same image) writes every preset's seccomp profile into the
    kubelet's Localhost root and says that this node has no AppArmor."""
    for f in SECCOMP_DIR.glob("*.json"):
        f.unlink()
    old = daemonset_pod(api, PLUGIN_NS, INSTALLER_SELECTOR)
    kubectl("-n", PLUGIN_NS, "delete", "pod", old["metadata"]["name"], "--wait=false")
    new = daemonset_pod(api, PLUGIN_NS, INSTALLER_SELECTOR, not_uid=old["metadata"]["uid"])
    cm = api.get(f"/api/v1/namespaces/{PLUGIN_NS}/configmaps/fuse-device-plugin-profiles")
    wanted = sorted(k for k in cm["data"] if k.endswith(".json"))

    def installed() -> list[str] | None:
        have = sorted(f.name for f in SECCOMP_DIR.glob("*.json"))
        return have if have == wanted else None

    have = wait_for(installed, 60, f"{wanted} in {SECCOMP_DIR}",
                    detail=lambda: kubectl("-n", PLUGIN_NS, "logs", new["metadata"]["name"]))
    logs = kubectl("-n", PLUGIN_NS, "logs", new["metadata"]["name"]).splitlines()
    said = [ln for ln in logs if "apparmor_unavailable" in ln]
    seccomp_lines = [ln for ln in logs if "kind=seccomp" in ln]
    proof = evidence("installer", f"{SECCOMP_DIR}: {have}", *seccomp_lines, *said)
    for name in have:
        assert json.loads((SECCOMP_DIR / name).read_text()) == json.loads(cm["data"][name]), (
            f"{SECCOMP_DIR / name} differs from the ConfigMap's {name}\n{proof}")
    assert said, "the installer never said that AppArmor is unavailable:\n" + "\n".join(logs)


def with_component(overlay: Path, component: str) -> Path:
    """A kustomization of the user's own beside manifests/ that adds one component:
    `resources: [../manifests]`, `components: [../manifests/COMPONENT]` (the form each
    component's header shows; kustomize takes relative paths only)."""
    dst = overlay.parent / f"with-{component}"
    dst.mkdir(exist_ok=True)
    write_json(dst / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../{overlay.name}"],
        "components": [f"../{overlay.name}/{component}"]})
    return dst


def shipped_objects(kubectl: Kubectl, overlay: Path, tmp: Path) -> list[dict[str, Any]]:
    """Every object the repository ships under manifests/, as a user would build it: each
    Kustomization with kubectl's kustomize (manifests/ alone and with each component),
    and each YAML file that no kustomization uses (such as the user-namespaced broker
    example) as it is. Objects built more than once are counted once."""
    kustomizations = {d.parent: yaml.safe_load(d.read_text())
                      for d in MANIFESTS.glob("**/kustomization.yaml")}
    components = sorted(d.name for d, k in kustomizations.items() if k["kind"] == "Component")
    roots = [overlay, *(with_component(overlay, c) for c in components),
             *sorted(d for d, k in kustomizations.items()
                     if k["kind"] == "Kustomization" and d != MANIFESTS)]
    # Files a kustomization builds from: its resources and its patches' files.
    used = {(d / r).resolve() for d, k in kustomizations.items()
            for r in [*(k.get("resources") or []),
                      *(p["path"] for p in k.get("patches") or [] if "path" in p)]}
    docs = [doc for root in roots
            for doc in yaml.safe_load_all(kubectl("kustomize", str(root))) if doc]
    for f in sorted(MANIFESTS.glob("**/*.yaml")):
        if f.name != "kustomization.yaml" and f.resolve() not in used:
            docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    unique = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
              for d in docs}
    return list(unique.values())


def apparmor_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """Each container's appArmorProfile, by container name."""
    spec = obj.get("spec") or {}
    spec = (spec.get("template") or {}).get("spec", spec)
    return {c["name"]: c["securityContext"]["appArmorProfile"]
            for kind in ("initContainers", "containers") for c in spec.get(kind) or []
            if "appArmorProfile" in (c.get("securityContext") or {})}


def test_every_shipped_manifest_is_accepted_by_the_api_server_apparmor_fields_kept(
    cluster: Cluster, kubectl: Kubectl, overlay: Path, tmp_path: Path
) -> None:
    """Every object under manifests/ (the plugin, every component, the examples, the
    user-namespaced variant) applied to the API server as a server-side dry run, after
    their namespaces: all accepted (validation, defaulting and admission, Pod Security
    included), and every `securityContext.appArmorProfile` kept as sent."""
    docs = shipped_objects(kubectl, overlay, tmp_path)
    namespaces = [d for d in docs if d["kind"] == "Namespace"]
    rest = [d for d in docs if d["kind"] != "Namespace"]
    kubectl(*APPLY, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                 "items": namespaces}))
    out = kubectl.run(*APPLY, "--dry-run=server", "-o", "json", "-f", "-",
                      stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest}),
                      check=False)
    returned = json.loads(out.stdout)["items"] if out.returncode == 0 else []
    sent = {(d["kind"], d["metadata"]["name"]): apparmor_fields(d) for d in rest}
    kept = {(d["kind"], d["metadata"]["name"]): apparmor_fields(d) for d in returned}
    with_profiles = {k: v for k, v in sent.items() if v}
    proof = evidence(
        "manifests-accepted",
        f"kubectl apply --dry-run=server of {len(rest)} objects (after {len(namespaces)} "
        f"namespaces): rc={out.returncode} {out.stderr.strip()}",
        *(f"{kind}/{name}: sent appArmorProfile {v}, the server kept "
          f"{kept.get((kind, name))}" for (kind, name), v in with_profiles.items()))
    assert out.returncode == 0, proof
    assert sorted(kept) == sorted(sent), proof
    assert with_profiles, proof
    for key, v in with_profiles.items():
        assert kept[key] == v, proof


def test_kubelet_refuses_an_apparmor_profile_on_a_node_without_apparmor(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str],
    tmp_path: Path
) -> None:
    """The README's instruction for nodes without AppArmor ("drop `appArmorProfile`"),
    shown by not following it: the sshfs example as shipped, with its Localhost AppArmor
    profile, is admitted by the API server and refused by this node's kubelet, which has
    no AppArmor to enforce it with; the pod fails before any container starts."""
    name = "sshfs-apparmor"
    pod = example_doc(SSHFS_FILE, "Pod")
    pod["metadata"] = {"name": name, "namespace": EXAMPLES_NS}
    pod["spec"]["containers"][0]["image"] = images["EXAMPLE_SSHFS_IMAGE"]
    kubectl(*APPLY, "-f", str(EXAMPLES / "namespace.yaml"))
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(pod))
    try:
        def failed() -> dict[str, Any] | None:
            found = [p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] == name]
            return found[0] if found and found[0]["status"].get("phase") == "Failed" else None

        refused = wait_for(failed, 90, f"pod {name} Failed",
                           detail=lambda: events_text(api, EXAMPLES_NS, name))
        status = refused["status"]
        proof = evidence("apparmor-refused", pod_summary(refused),
                         f"reason={status.get('reason')} message={status.get('message')}",
                         events_text(api, EXAMPLES_NS, name),
                         f"sent appArmorProfile {apparmor_fields(pod)}, stored "
                         f"{apparmor_fields(refused)}")
        assert status.get("reason") == "AppArmor", proof
        assert "AppArmor is not enabled on the host" in status.get("message", ""), proof
        assert not status.get("containerStatuses") or all(
            "running" not in (c.get("state") or {}) for c in status["containerStatuses"]), proof
        assert apparmor_fields(refused) == apparmor_fields(pod), proof
    finally:
        delete_pod(kubectl, api, EXAMPLES_NS, name)


# ---------------------------------------------------------------- 3. the examples


def test_sshfs_example_mounts_with_its_localhost_seccomp_profile(
    sshfs_pod: str, servers: Servers, kubectl: Kubectl, api: Api
) -> None:
    """manifests/examples/sshfs-pod.yaml against an sshd pod: the mount carries data both
    ways, and the container runs under the Localhost profile fuse-device-plugin/sshfs.json
    (seccomp filter on; `unshare` refused, which containerd's RuntimeDefault would allow
    to a container holding SYS_ADMIN)."""
    token = uuid.uuid4().hex
    exec_in(kubectl, SERVERS_NS, "sshd", f"echo from-server-{token} > /srv/data/in.txt")
    read = exec_in(kubectl, EXAMPLES_NS, sshfs_pod, "cat /mnt/remote/in.txt")
    exec_in(kubectl, EXAMPLES_NS, sshfs_pod, f"echo from-pod-{token} > /mnt/remote/out.txt")
    back = exec_in(kubectl, SERVERS_NS, "sshd", "cat /srv/data/out.txt")
    profile, mode = seccomp_seen(kubectl, api, sshfs_pod)
    unshare = exec_in(kubectl, EXAMPLES_NS, sshfs_pod, "unshare --mount true; echo rc=$?")
    mount = exec_in(kubectl, EXAMPLES_NS, sshfs_pod, "grep ' /mnt/remote ' /proc/mounts")
    proof = evidence("sshfs", mount, f"server -> pod: {read}", f"pod -> server: {back}",
                     f"seccompProfile {profile}; {mode}; unshare: {unshare}")
    assert read == f"from-server-{token}", proof
    assert back == f"from-pod-{token}", proof
    assert_under_preset(profile, mode, "sshfs", proof)
    assert "Operation not permitted" in unshare, proof
    assert "rc=1" in unshare, proof


S3FS_FILE = "s3fs-pod.yaml"
S3FS_POD = "s3fs-example"


def test_s3fs_example_mounts_a_moto_bucket(
    *, deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    images: dict[str, str], tmp_path: Path
) -> None:
    """manifests/examples/s3fs-pod.yaml against moto's S3 server in the cluster: the
    credentials and S3_URL replaced, and `-o use_path_request_style` added, which any
    endpoint addressed by IP (moto, MinIO) needs: virtual-host style would look up
    <bucket>.<ip>. Data both ways, under the Localhost profile s3fs.json."""
    pod = example_doc(S3FS_FILE, "Pod")
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    bucket = env["BUCKET"]
    script = c["args"][0]
    assert "-o use_cache=/tmp" in script, "the s3fs example's command changed: update this test"
    token = uuid.uuid4().hex
    s3 = servers.s3()
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="in.txt", Body=f"from-s3-{token}".encode())
    ov = example_overlay(tmp_path, S3FS_FILE, "fuse-example-s3fs", images["EXAMPLE_S3FS_IMAGE"], [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3fs-credentials"},
         "stringData": {"passwd": f"{S3_KEY}:{S3_SECRET}"}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": S3FS_POD},
         "spec": {"containers": [{
             "name": c["name"],
             "env": [{"name": "S3_URL", "value": servers.moto_url}],
             "args": [script.replace("-o use_cache=/tmp",
                                     "-o use_cache=/tmp -o use_path_request_style")],
         }]}},
    ])
    kubectl(*APPLY, "-k", str(ov))
    try:
        mount = wait_mounted(kubectl, api, S3FS_POD, "/mnt/bucket", "fuse.s3fs")
        read = exec_in(kubectl, EXAMPLES_NS, S3FS_POD, "cat /mnt/bucket/in.txt")
        exec_in(kubectl, EXAMPLES_NS, S3FS_POD, f"echo from-pod-{token} > /mnt/bucket/out.txt")

        def uploaded() -> bytes:
            body: bytes = s3.get_object(Bucket=bucket, Key="out.txt")["Body"].read()
            return body

        back = wait_for(uploaded, 30, "out.txt in the bucket").decode().strip()
        profile, mode = seccomp_seen(kubectl, api, S3FS_POD)
        proof = evidence("s3fs", mount, f"bucket -> pod: {read}", f"pod -> bucket: {back}",
                         f"seccompProfile {profile}; {mode}")
        assert read == f"from-s3-{token}", proof
        assert back == f"from-pod-{token}", proof
        assert_under_preset(profile, mode, "s3fs", proof)
    finally:
        delete_pod(kubectl, api, EXAMPLES_NS, S3FS_POD)
        kubectl("-n", EXAMPLES_NS, "delete", "secret", "s3fs-credentials", "--ignore-not-found")


LXCFS_FILE = "lxcfs-daemonset.yaml"


def test_lxcfs_example_shows_the_pods_memory_limit(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str],
    tmp_path: Path
) -> None:
    """manifests/examples/lxcfs-daemonset.yaml: the workload's /proc/meminfo, served by the
    container's own lxcfs, shows the container's memory limit, not the node's memory."""
    ds = example_doc(LXCFS_FILE, "DaemonSet")
    limit = ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    m = re.fullmatch(r"(\d+)Mi", limit)
    assert m, f"unexpected memory limit {limit!r} in the example"
    want_kb = int(m[1]) * 1024
    host_kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())[1])  # type: ignore[index]
    ov = example_overlay(tmp_path, LXCFS_FILE, "fuse-example-lxcfs",
                         images["EXAMPLE_LXCFS_IMAGE"], [])
    kubectl(*APPLY, "-k", str(ov))
    name = ds["metadata"]["name"]
    selector = ",".join(f"{k}={v}" for k, v in ds["spec"]["selector"]["matchLabels"].items())
    try:
        def meminfo() -> str | None:
            pods = api.pods(EXAMPLES_NS, selector)
            if not pods or pods[0]["status"].get("phase") != "Running":
                return None
            out = kubectl.run("-n", EXAMPLES_NS, "logs", pods[0]["metadata"]["name"],
                              check=False).stdout
            return out if "MemTotal" in out else None

        out = wait_for(meminfo, 120, "the lxcfs workload to print /proc/meminfo", interval=1,
                       detail=lambda: "\n".join(pod_summary(p)
                                                for p in api.pods(EXAMPLES_NS, selector)))
        total = re.search(r"MemTotal:\s+(\d+) kB", out)
        shown = [ln for ln in out.splitlines() if ln.startswith(("MemTotal", "MemAvailable",
                                                                   "CPUs", "uptime"))]
        proof = evidence("lxcfs", *shown,
                         f"limit {limit} = {want_kb} kB; the node has {host_kb} kB")
        assert total, proof
        assert int(total[1]) == want_kb, proof
        assert want_kb != host_kb, proof
    finally:
        kubectl("-n", EXAMPLES_NS, "delete", "daemonset", name, "--ignore-not-found",
                "--wait=false")
        for p in api.pods(EXAMPLES_NS, selector):
            delete_pod(kubectl, api, EXAMPLES_NS, p["metadata"]["name"])


# ---------------------------------------------------------------- 4. the scheduler

SCHED_NS = "fdp-e2e-sched"


def test_scheduler_places_pods_by_fuse_slots(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """The plugin at 2 slots: of three pods asking for one each, two run and the third stays
    Pending with `Insufficient github.com/fuse`; deleting one lets the third run."""
    others = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in api.pods()
              if any(RESOURCE in (c.get("resources", {}).get("limits") or {})
                     for c in p["spec"]["containers"])]
    assert not others, f"pods already holding {RESOURCE}: {others}"
    old = deployed["metadata"]["uid"]
    kubectl("-n", PLUGIN_NS, "set", "env", f"daemonset/{PLUGIN_DS}", f"{SLOTS_ENV}=2")
    names = ["fuse-a", "fuse-b", "fuse-c"]
    try:
        daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR, not_uid=old)
        two = wait_allocatable(api, 2)
        kubectl(*APPLY, "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SCHED_NS}},
            *(fuse_pod(n, images["WORKLOAD_IMAGE"], SCHED_NS) for n in names)]}))

        def split() -> tuple[list[str], list[str]] | None:
            pods = {p["metadata"]["name"]: p for p in api.pods(SCHED_NS)}
            running = sorted(n for n, p in pods.items() if pod_ready(p))
            pending = sorted(n for n, p in pods.items() if p["status"].get("phase") == "Pending"
                             and any("Insufficient github.com/fuse" in (e.get("message") or "")
                                     for e in api.events(SCHED_NS, n)))
            return (running, pending) if len(running) == 2 and len(pending) == 1 else None

        running, pending = wait_for(
            split, 120, "two pods Running and one Pending for lack of slots", interval=0.5,
            detail=lambda: "\n".join(pod_summary(p) + "\n" + events_text(api, SCHED_NS,
                                     p["metadata"]["name"]) for p in api.pods(SCHED_NS)))
        why = events_text(api, SCHED_NS, pending[0])
        proof = evidence("scheduler", two, f"Running: {running}", f"Pending: {pending[0]}", why)
        assert "Insufficient github.com/fuse" in why, proof
        kubectl("-n", SCHED_NS, "delete", "pod", running[0], "--grace-period=1", "--wait=false")
        third = wait_ready(api, SCHED_NS, pending[0])
        evidence("scheduler", f"deleted {running[0]}: " + pod_summary(third),
                 events_text(api, SCHED_NS, pending[0]).splitlines()[-1])
    finally:
        for n in names:
            kubectl("-n", SCHED_NS, "delete", "pod", n, "--ignore-not-found", "--grace-period=1",
                    "--wait=false")
        for n in names:
            wait_gone(api, SCHED_NS, n)
        kubectl("-n", PLUGIN_NS, "set", "env", f"daemonset/{PLUGIN_DS}", f"{SLOTS_ENV}-")
        rollout(kubectl, PLUGIN_DS)
        wait_allocatable(api, DEFAULT_SLOTS)


# ---------------------------------------------------------------- 5. restarts


def test_deleted_plugin_pod_comes_back_and_a_running_mount_keeps_working(
    sshfs_pod: str, deployed: dict[str, Any], kubectl: Kubectl, api: Api
) -> None:
    """Delete the plugin pod: the DaemonSet recreates it, the Node's slots come back, and
    the sshfs pod that got /dev/fuse from the old one still reads and writes its mount."""
    old = daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR)
    kubectl("-n", PLUGIN_NS, "delete", "pod", old["metadata"]["name"], "--wait=true")
    new = daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR, not_uid=old["metadata"]["uid"])
    line = wait_allocatable(api, DEFAULT_SLOTS)
    token = uuid.uuid4().hex
    exec_in(kubectl, EXAMPLES_NS, sshfs_pod, f"echo after-{token} > /mnt/remote/after.txt")
    back = exec_in(kubectl, SERVERS_NS, "sshd", "cat /srv/data/after.txt")
    proof = evidence("plugin-pod-deleted", f"old {old['metadata']['name']}",
                     "new " + pod_summary(new), line,
                     f"sshfs pod wrote through its mount afterwards: {back}")
    assert back == f"after-{token}", proof


def ready_heartbeat(api: Api) -> str:
    node = api.node()
    return str(next(c["lastHeartbeatTime"] for c in node["status"]["conditions"]
                    if c["type"] == "Ready"))


def test_kubelet_restart_brings_capacity_back(
    deployed: dict[str, Any], cluster: Cluster, kubectl: Kubectl, api: Api
) -> None:
    """Restart the kubelet: the running plugin pod registers again on its own (no
    container restart) and the Node's slots are back. Only Node statuses the new kubelet
    posted count (a new heartbeat): until one, the API still shows the old kubelet's."""
    name = deployed["metadata"]["name"]
    restarts = deployed["status"]["containerStatuses"][0]["restartCount"]
    before = plugin_log(kubectl, name).count(" registered ")
    old_beat = ready_heartbeat(api)
    cluster.restart_kubelet()
    posted: list[tuple[int | None, int | None]] = []

    def back() -> bool:
        if ready_heartbeat(api) == old_beat:
            return False
        now = fuse_resources(api)
        if not posted or posted[-1] != now:
            posted.append(now)
        return now == (DEFAULT_SLOTS, DEFAULT_SLOTS)

    wait_for(back, 90, f"the restarted kubelet to post {RESOURCE} = {DEFAULT_SLOTS}",
             interval=0.5, detail=lambda: f"posted (capacity, allocatable): {posted}")
    wait_for(lambda: plugin_log(kubectl, name).count(" registered ") > before, 30,
             "the plugin to log a new registration")
    pod = daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR)
    regs = [ln for ln in plugin_log(kubectl, name).splitlines() if " registered " in ln]
    proof = evidence("kubelet-restart",
                     f"(capacity, allocatable) the new kubelet posted, in turn: {posted}",
                     *regs[-2:], pod_summary(pod))
    assert pod["metadata"]["name"] == name, proof
    assert pod["status"]["containerStatuses"][0]["restartCount"] == restarts, proof


ROLL_NS = "fdp-e2e-rollout"


def test_rollout_restart_completes_and_rejects_no_fuse_pod(
        deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]) -> None:
    """`kubectl rollout restart` of the plugin DaemonSet finishes (a new pod Ready, the
    slots back), and a FUSE pod created every second meanwhile is never rejected (issue
    35): the new pod registers on its own socket before the old one is deleted (maxSurge),
    so the kubelet never marks the slots unhealthy."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ROLL_NS}}))
    old = deployed["metadata"]
    try:
        with PodEverySecond(api, images["WORKLOAD_IMAGE"], ROLL_NS) as stream:
            wait_for(lambda: len(stream.names) >= 3, 30, "three pods before the rollout")
            began = time.monotonic()
            out = kubectl("-n", PLUGIN_NS, "rollout", "restart", f"daemonset/{PLUGIN_DS}").strip()
            status = rollout(kubectl, PLUGIN_DS)
            new = daemonset_pod(api, PLUGIN_NS, PLUGIN_SELECTOR, not_uid=old["uid"])
            wait_gone(api, PLUGIN_NS, old["name"])
            took = time.monotonic() - began
            after = len(stream.names) + 3
            wait_for(lambda: len(stream.names) >= after, 30, "three pods after the rollout")
        ended = stream.phases()
        line = wait_allocatable(api, DEFAULT_SLOTS)
        stamp = new["metadata"].get("annotations", {}).get("kubectl.kubernetes.io/restartedAt")
        rejected = {n: st.get("message", "") for n, st in ended.items()
                    if st.get("phase") != "Succeeded"}
        handoff = [ln for ln in plugin_log(kubectl, new["metadata"]["name"]).splitlines()
                   if "registered" in ln][:1]
        proof = evidence("rollout-restart", out, status, pod_summary(new),
                         f"restartedAt {stamp}", line,
                         f"rollout restart -> old pod {old['name']} gone: {took:.1f}s",
                         *handoff, f"{len(ended)} FUSE pods created one a second: "
                         f"{len(ended) - len(rejected)} Succeeded, rejected: {rejected}",
                         *stream.errors, stream.longest_wait())
        assert "successfully rolled out" in status, proof
        assert stamp, proof
        assert not stream.errors, proof
        assert not rejected, proof
    finally:
        kubectl("delete", "namespace", ROLL_NS, "--ignore-not-found", "--wait=true",
                timeout=180)


# ---------------------------------------------------------------- 6. Pod Security admission

BASELINE_NS = "fdp-e2e-baseline"


@pytest.mark.parametrize("host_users", [True, False], ids=["host-users", "user-namespace"])
def test_pod_security_baseline_refuses_the_default_mode_pod(
    cluster: Cluster, kubectl: Kubectl, api: Api, host_users: bool
) -> None:
    """Default mode's sshfs example (CAP_SYS_ADMIN, its own seccomp profile) sent to a
    namespace labelled `pod-security.kubernetes.io/enforce: baseline`: the API server's
    Pod Security admission refuses it with its own message, also as a user-namespaced
    pod (`hostUsers: false` relaxes only the user rules, never added capabilities). That is
    what broker mode is for."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": BASELINE_NS, "labels": {
            "pod-security.kubernetes.io/enforce": "baseline",
            "pod-security.kubernetes.io/enforce-version": "latest"}}}))
    pod = example_doc(SSHFS_FILE, "Pod")
    pod["metadata"] = {"name": "sshfs-default-mode", "namespace": BASELINE_NS}
    if not host_users:
        pod["spec"]["hostUsers"] = False
    out = kubectl.run(*APPLY, "-f", "-", stdin=json.dumps(pod), check=False)
    said = (out.stderr or out.stdout).strip()
    stored = [p["metadata"]["name"] for p in api.pods(BASELINE_NS)]
    proof = evidence("pod-security", f"namespace {BASELINE_NS} enforce=baseline; "
                     f"hostUsers={pod['spec'].get('hostUsers', True)}",
                     f"kubectl apply: rc={out.returncode} {said}", f"pods stored: {stored}")
    assert out.returncode != 0, proof
    assert 'violates PodSecurity "baseline:latest"' in said, proof
    assert "SYS_ADMIN" in said, proof
    assert "sshfs-default-mode" not in stored, proof


# ---------------------------------------------------------------- 7. CDI

CDI_DIR = Path("/var/run/cdi")
CDI_NS = "fdp-e2e-cdi"


def cdi_specs() -> list[Path]:
    """The CDI spec files on the node that name our resource."""
    return sorted(f for f in CDI_DIR.glob("*.json") if RESOURCE in f.read_text())


def test_cdi_answer_is_consumed_by_containerd(
    *, deployed: dict[str, Any], cluster: Cluster, kubectl: Kubectl, api: Api, overlay: Path,
    images: dict[str, str], tmp_path: Path
) -> None:
    """The `cdi` component, added as its header shows: the plugin writes
    its CDI spec into the node's /var/run/cdi and answers `github.com/fuse=fuse` with each
    allocation; the kubelet passes the name in CreateContainer and containerd 2 resolves
    it from the spec (a pod gets /dev/fuse). With the spec file gone, containerd refuses
    the next pod's container as an unresolvable CDI device: the name, not only the
    DeviceSpec, reaches it and is resolved there."""
    kubectl(*APPLY, "-k", str(with_component(overlay, "cdi")))
    try:
        rolled = rollout(kubectl, PLUGIN_DS)
        wait_allocatable(api, DEFAULT_SLOTS)
        specs = wait_for(cdi_specs, 60, f"the plugin's CDI spec in {CDI_DIR}")
        spec = json.loads(specs[0].read_text())
        kubectl(*APPLY, "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CDI_NS}}))
        first = fuse_pod("cdi-a", images["WORKLOAD_IMAGE"], CDI_NS)
        kubectl(*APPLY, "-f", "-", stdin=json.dumps(first))
        running = wait_ready(api, CDI_NS, "cdi-a")
        dev = exec_in(kubectl, CDI_NS, "cdi-a", "ls -l /dev/fuse")
        saved = specs[0].read_bytes()
        specs[0].unlink()
        second = fuse_pod("cdi-b", images["WORKLOAD_IMAGE"], CDI_NS)
        kubectl(*APPLY, "-f", "-", stdin=json.dumps(second))

        def refused() -> str | None:
            text = events_text(api, CDI_NS, "cdi-b")
            return text if "CDI" in text and "unresolvable" in text else None

        why = wait_for(refused, 90, "containerd to refuse the CDI device without its spec",
                       detail=lambda: events_text(api, CDI_NS, "cdi-b"))
        specs[0].write_bytes(saved)
        proof = evidence(
            "cdi", rolled, f"{specs[0]}: kind {spec['kind']}, devices "
            f"{[d['name'] for d in spec['devices']]}, cdiVersion {spec['cdiVersion']}",
            pod_summary(running), f"in the pod: {dev}",
            f"spec removed, second pod: {why.strip().splitlines()[-1]}")
        assert spec["kind"] == RESOURCE, proof
        assert "crw" in dev, proof
        assert "unresolvable CDI devices" in why, proof
        assert f"{RESOURCE}=fuse" in why, proof
    finally:
        kubectl("delete", "namespace", CDI_NS, "--ignore-not-found", "--wait=true",
                timeout=180)
        kubectl(*APPLY, "-k", str(overlay))
        rollout(kubectl, PLUGIN_DS)
        wait_allocatable(api, DEFAULT_SLOTS)


# ---------------------------------------------------------------- 8. default mode, user namespace

USERNS_POD = "sshfs-userns-default"


def test_default_mode_in_a_user_namespace(
    *, deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    images: dict[str, str], tmp_path: Path
) -> None:
    """The default-mode sshfs example with `hostUsers: false`, in its `privileged`
    namespace: the kubelet and containerd 2 give the pod a user namespace of its own (its
    root is an unprivileged uid range of the node), CAP_SYS_ADMIN counts only inside it,
    and FUSE, which the kernel lets a user namespace mount, still works: data both ways.
    What it cannot do: pass `baseline` (test_pod_security_baseline_refuses...), and open
    /dev/fuse on a node whose node is 0600 (the containers stage's test_userns)."""
    apply_sshfs_example(kubectl, servers, images, tmp_path, name=USERNS_POD,
                        spec={"hostUsers": False})
    try:
        mount = wait_mounted(kubectl, api, USERNS_POD, "/mnt/remote", "fuse.sshfs")
        [pod] = [p for p in api.pods(EXAMPLES_NS) if p["metadata"]["name"] == USERNS_POD]
        uid_map = exec_in(kubectl, EXAMPLES_NS, USERNS_POD, "cat /proc/self/uid_map")
        token = uuid.uuid4().hex
        exec_in(kubectl, SERVERS_NS, "sshd", f"echo userns-{token} > /srv/data/userns.txt")
        read = exec_in(kubectl, EXAMPLES_NS, USERNS_POD, "cat /mnt/remote/userns.txt")
        exec_in(kubectl, EXAMPLES_NS, USERNS_POD, f"echo back-{token} > /mnt/remote/back.txt")
        back = exec_in(kubectl, SERVERS_NS, "sshd", "cat /srv/data/back.txt")
        inside, host, count = (int(x) for x in uid_map.split()[:3])
        proof = evidence("userns-default", pod_summary(pod),
                         f"stored hostUsers={pod['spec'].get('hostUsers')}",
                         f"uid_map: {uid_map.strip()}", mount, f"server -> pod: {read}",
                         f"pod -> server: {back}")
        assert pod["spec"].get("hostUsers") is False, proof
        assert (inside, count) == (0, 65536), proof
        assert host >= 65536, proof
        assert read == f"userns-{token}", proof
        assert back == f"back-{token}", proof
    finally:
        delete_sshfs_example(kubectl, api, USERNS_POD)


def test_a_fuse_pod_sees_no_gpu_in_default_mode(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str]
) -> None:
    """Stand-in GPUs on the node: a privileged pod lists them all; a pod that asks
    `github.com/fuse: 1` from the device plugin gets /dev/fuse and nothing else."""
    gpu.prove_isolation(kubectl, api, images["WORKLOAD_IMAGE"], "default")


# ---------------------------------------------------------------- 8b. rootless builds

ROOTLESS = EXAMPLES / "rootless-build"
ROOTLESS_POD = "rootless-build-example"
# What the built images print (tests/containers/test_rootless_build.py says why): a RUN
# step's file from the context's file and the first stage's, as uid 0 of the build.
ROOTLESS_OUTPUT = "hello from the build context built in stage one 0"
# manifests/examples/rootless-build-users/ (issue 48): the image's user, the owner of its
# files, a file it wrote in a RUN step after USER.
ROOTLESS_USERS = EXAMPLES / "rootless-build-users"
ROOTLESS_USERS_POD = "rootless-build-users"
ROOTLESS_USERS_OUTPUT = "1001 app app:app app:app written by app"


def test_rootless_build_example_builds_and_runs_as_uid_1000_at_baseline(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str],
    tmp_path: Path
) -> None:
    """manifests/examples/rootless-build/ applied with `kubectl apply -k` as its header
    says (after manifests/, whose installer put the preset's seccomp profile on the node;
    `appArmorProfile` removed, as for every example on this node without AppArmor): its
    namespace enforces `baseline` and warns for `restricted`; the pod, uid 1000 of a
    `hostUsers: false` pod with no capability, builds the Containerfile (FROM, COPY, RUN,
    a second stage) with buildah and with podman, and each built image runs."""
    rootless_example(kubectl, api, images, tmp_path, example=ROOTLESS, pod_name=ROOTLESS_POD,
                     output=ROOTLESS_OUTPUT)


def test_rootless_build_users_example_builds_an_image_that_runs_as_its_own_user_at_baseline(
    deployed: dict[str, Any], kubectl: Kubectl, api: Api, images: dict[str, str],
    tmp_path: Path
) -> None:
    """manifests/examples/rootless-build-users/ (issue 48) the same way: uid 1000 (no
    capability in effect; SETUID and SETGID added, privilege escalation allowed) maps
    /etc/subuid's ranges through the image's newuidmap and newgidmap; the Containerfile
    adds a user, chowns to it and switches to it with USER, and each built image runs as
    that user (uid 1001)."""
    rootless_example(kubectl, api, images, tmp_path, example=ROOTLESS_USERS,
                     pod_name=ROOTLESS_USERS_POD, output=ROOTLESS_USERS_OUTPUT)


def rootless_example(kubectl: Kubectl, api: Api, images: dict[str, str], tmp_path: Path, *,
                     example: Path, pod_name: str, output: str) -> None:
    """``example`` applied with its image, its pod's `RAN` lines awaited and checked."""
    ov = tmp_path / example.name
    ov.mkdir()
    for f in ("namespace.yaml", "build-pod.yaml"):
        (ov / f).write_text((example / f).read_text())
    name, _, tag = images["EXAMPLE_ROOTLESS_BUILD_IMAGE"].rpartition(":")
    write_json(ov / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["namespace.yaml", "build-pod.yaml"],
        "images": [{"name": "fuse-example-rootless-build", "newName": name, "newTag": tag}],
        "patches": without_apparmor(f"{example.name}/build-pod.yaml")})
    namespace = yaml.safe_load((example / "namespace.yaml").read_text())["metadata"]["name"]
    applied = kubectl.run(*APPLY, "-k", str(ov))
    try:
        def ran() -> str | None:
            out = kubectl.run("-n", namespace, "logs", pod_name, check=False).stdout
            return out if "RAN podman:" in out else None

        def failed() -> str:
            pods = [p for p in api.pods(namespace) if p["metadata"]["name"] == pod_name]
            return "\n".join(pod_summary(p) for p in pods) + "\n" + kubectl.run(
                "-n", namespace, "logs", pod_name, check=False).stdout[-3000:]

        out = wait_for(ran, 600, f"{pod_name} to build and run both images", interval=2,
                       detail=failed)
        [pod] = [p for p in api.pods(namespace) if p["metadata"]["name"] == pod_name]
        labels = json.loads(kubectl("get", "namespace", namespace, "-o", "json"))[
            "metadata"]["labels"]
        status = exec_in(kubectl, namespace, pod_name,
                         "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; "
                         "cat /proc/self/uid_map")
        ran_lines = {tool: next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                                 if ln.startswith(f"RAN {tool}:")), None)
                     for tool in ("buildah", "podman")}
        warnings = [ln for ln in applied.stderr.splitlines() if "PodSecurity" in ln]
        proof = evidence(
            example.name,
            *(f"namespace {namespace}: {k}={v}" for k, v in sorted(labels.items())
              if k.startswith("pod-security.kubernetes.io/")),
            *warnings, pod_summary(pod),
            f"stored hostUsers={pod['spec'].get('hostUsers')}, securityContext "
            f"{pod['spec']['containers'][0]['securityContext']}", *status.splitlines(),
            *(f"RAN {tool}: {got}" for tool, got in ran_lines.items()))
        assert labels["pod-security.kubernetes.io/enforce"] == "baseline", proof
        assert any("restricted" in w and "procMount" in w for w in warnings), proof
        assert pod["spec"].get("hostUsers") is False, proof
        assert status.split()[0] == "1000", proof
        assert re.search(r"CapEff:\s+0+\n", status + "\n"), proof
        assert not status.strip().endswith("0 4294967295"), proof
        assert ran_lines == {"buildah": output, "podman": output}, proof
    finally:
        delete_pod(kubectl, api, namespace, pod_name)
        kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")


# ---------------------------------------------------------------- 9. the runtime's defaults

DEFAULTS_NS = "fdp-e2e-defaults"
DEFAULTS_POD = "asks-for-nothing"


def capability_mask(names: tuple[str, ...]) -> int:
    return sum(1 << oci.ALL_CAPABILITIES.index(name) for name in names)


def rules_by_name(profile: dict[str, Any]) -> dict[str, list[tuple[Any, ...]]]:
    """A resolved filter as what it does per system call: each rule naming the call, in
    order, as (action, errno, arguments); spelling the runtimes vary (an omitted
    valueTwo, the rule lists' grouping) does not count."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for rule in profile["syscalls"]:
        action = converter.effective_action(rule["action"], rule.get("errnoRet"))
        args = tuple((a["index"], a["value"], a.get("valueTwo", 0), a["op"])
                     for a in rule.get("args") or ())
        for name in rule["names"]:
            out.setdefault(name, []).append((*action, args))
    return out


def test_a_pod_that_asks_for_nothing_gets_what_the_hostile_tests_attack_with(
    *, deployed: dict[str, Any], cluster: Cluster, kubectl: Kubectl, api: Api,
    images: dict[str, str]
) -> None:
    """A tenant's pod with no capabilities of its own and RuntimeDefault seccomp (what
    `baseline` lets anyone run), on the runtime FUSE_E2E_RUNTIME chose: its bounding set
    is the runtime's default set that tests/lib/runtimes.py hands the hostile tests
    (CRI-O's lacks CAP_SYS_CHROOT), and on CRI-O the seccomp filter the runtime wrote
    into the container's OCI config is, call by call after libseccomp's resolution, the
    one tests/lib/profiles.runtime_default() builds for them. On containerd the filters
    are compared and the differences written to the evidence only: the hostile tests
    model containerd's RuntimeDefault with containers-common's file, and containerd 2.3
    writes its own (an EPERM default, 373 calls here against 429): a known gap, not this
    test's to close."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEFAULTS_NS}}))
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": DEFAULTS_POD, "namespace": DEFAULTS_NS},
        "spec": {
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "image": images["WORKLOAD_IMAGE"],
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["/bin/sh", "-c", "exec sleep 3600"]}],
        },
    }
    try:
        kubectl(*APPLY, "-f", "-", stdin=json.dumps(pod))
        running = wait_ready(api, DEFAULTS_NS, DEFAULTS_POD)
        status = exec_in(kubectl, DEFAULTS_NS, DEFAULTS_POD, "grep -E '^(CapBnd|Seccomp):' "
                         "/proc/self/status")
        fields = dict(line.split(":\t") for line in status.splitlines())
        container_id = running["status"]["containerStatuses"][0]["containerID"]
        written = json.loads(runtime.oci_config(cluster, container_id).read_text())
        real = rules_by_name(converter.resolve(written["linux"]["seccomp"]))
        modelled = json.loads(profiles.runtime_default())
        ours = rules_by_name(modelled)
        differ = sorted(n for n in real.keys() | ours.keys() if real.get(n) != ours.get(n))
        wanted = runtimes.default_capabilities()
        proof = evidence(
            "runtime-defaults", f"runtime: {runtimes.name()} ({container_id})",
            pod_summary(running), f"CapBnd {fields['CapBnd']}, Seccomp {fields['Seccomp']}",
            f"the hostile tests' set: {' '.join(wanted)} = {capability_mask(wanted):016x}",
            f"seccomp: {len(real)} calls in {runtime.oci_config(cluster, container_id)}, "
            f"{len(ours)} modelled; differing: {differ[:20]}",
            *(f"  {n}: real {real.get(n)} modelled {ours.get(n)}" for n in differ[:5]))
        assert int(fields["CapBnd"], 16) == capability_mask(wanted), proof
        assert fields["Seccomp"].strip() == "2", proof
        if not runtimes.is_crio():
            return
        assert "CAP_SYS_CHROOT" not in wanted, proof
        assert (written["linux"]["seccomp"]["defaultAction"],
                written["linux"]["seccomp"].get("defaultErrnoRet")) == (
                    modelled["defaultAction"], modelled.get("defaultErrnoRet")), proof
        assert not differ, proof
    finally:
        kubectl("delete", "namespace", DEFAULTS_NS, "--ignore-not-found", "--wait=true",
                timeout=180)
