"""What the cluster tests do as a user would: kustomize overlays in temporary directories
(the shipped files copied, changed only where the README or the example's comments say to
change them), `kubectl apply -k`, and waits on the API's reports with deadlines."""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from tests.cluster.cluster import LOGDIR, NODE_NAME, Api, Kubectl, pod_ready
from tests.kubelet.node import wait_for
from tests.lib.background import Repeating

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
EXAMPLES = MANIFESTS / "examples"
RESOURCE = "github.com/fuse"
DEFAULT_SLOTS = 1000
PLUGIN_NS = "fuse-device-plugin"
EXAMPLES_NS = "fuse-examples"
PLUGIN_DS = "fuse-device-plugin"
INSTALLER_DS = "fuse-profile-installer"
BROKER_DS = "fuse-mount-broker"
LXCFS_DS = "fuse-lxcfs"  # broker mode's node-wide lxcfs (LXCFS views)
PLUGIN_SELECTOR = "app.kubernetes.io/component=device-plugin"
INSTALLER_SELECTOR = "app.kubernetes.io/component=profile-installer"
EVIDENCE = LOGDIR / "evidence.txt"
# `kubectl apply` as the README says it; the 1.37 server validates every field, the 1.30
# securityContext.appArmorProfile included.
APPLY = ("apply",)
# The plugin's environment twin of --slots (README, `serve` flags).
SLOTS_ENV = "FUSE_DEVICE_PLUGIN_SLOTS"
# How long a followed pod's `kubectl logs -f` may take to end once the pod has gone.
FOLLOW_END = 30


def evidence(scenario: str, *lines: str) -> str:
    """Record lines that prove a scenario (printed, and kept in LOGDIR/evidence.txt);
    returns them joined, for assertion messages."""
    text = "".join(f"[{scenario}] {line}\n" for line in lines)
    print(text, end="")
    EVIDENCE.parent.mkdir(parents=True, exist_ok=True)
    with open(EVIDENCE, "a") as f:
        f.write(text)
    return text


def quantity(value: str | None) -> int | None:
    """An integer resource quantity as the API prints it: "1k" is 1000."""
    if value is None:
        return None
    m = re.fullmatch(r"(\d+)(k|M|G)?", value)
    if not m:
        raise ValueError(f"not an integer quantity: {value!r}")
    return int(m[1]) * {None: 1, "k": 10**3, "M": 10**6, "G": 10**9}[m[2]]


def fuse_resources(api: Api) -> tuple[int | None, int | None]:
    """The Node's (capacity, allocatable) of github.com/fuse."""
    st = api.node()["status"]
    return quantity(st.get("capacity", {}).get(RESOURCE)), quantity(
        st.get("allocatable", {}).get(RESOURCE))


def wait_allocatable(api: Api, slots: int, timeout: float = 90) -> str:
    """Wait until the Node reports capacity and allocatable == slots; returns the line."""
    def seen() -> str | None:
        cap, alloc = fuse_resources(api)
        return (f"node {NODE_NAME}: capacity {RESOURCE}={cap} allocatable={alloc}"
                if cap == alloc == slots else None)

    line: str = wait_for(seen, timeout, f"node {RESOURCE} capacity = allocatable = {slots}",
                         interval=0.5, detail=lambda: f"node reports {fuse_resources(api)}")
    return line


def write_json(path: Path, obj: Any) -> None:
    # JSON is YAML, and quotes every string: an image tag such as 577005692e27 stays a
    # string (written as plain YAML, Go's parser reads it as a float).
    path.write_text(json.dumps(obj, indent=1) + "\n")


def manifests_overlay(tmp: Path, image: str) -> Path:
    """manifests/ copied, with the README's one change: `kustomize edit set image
    fuse-device-plugin=REGISTRY/fuse-device-plugin:TAG`, which rewrites `images:`."""
    dst = tmp / "manifests"
    shutil.copytree(MANIFESTS, dst)
    k = yaml.safe_load((dst / "kustomization.yaml").read_text())
    name, _, tag = image.rpartition(":")
    k["images"] = [{"name": "fuse-device-plugin", "newName": name, "newTag": tag}]
    write_json(dst / "kustomization.yaml", k)
    return dst


def example_overlay(tmp: Path, example: str, image_name: str, image: str,
                    patches: list[dict[str, Any]], *, apparmor: bool = False) -> Path:
    """One example file with its namespace, its tool image named and the placeholders
    replaced by strategic-merge patches, as the example's comments tell users; and, as
    they tell users of nodes without AppArmor (this one), `appArmorProfile` removed,
    unless ``apparmor`` (for the VM node, which enforces it)."""
    dst = tmp / Path(example).stem
    dst.mkdir(parents=True)
    for f in ["namespace.yaml", example]:
        shutil.copy(EXAMPLES / f, dst / f)
    name, _, tag = image.rpartition(":")
    write_json(dst / "kustomization.yaml", {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": EXAMPLES_NS,
        "resources": ["namespace.yaml", example],
        "images": [{"name": image_name, "newName": name, "newTag": tag}],
        "patches": [{"patch": json.dumps(p)} for p in patches]
        + ([] if apparmor else without_apparmor(example)),
    })
    return dst


def without_apparmor(example: str) -> list[dict[str, Any]]:
    """kustomize JSON patches that remove every container's `appArmorProfile` from the
    example's objects: the README's instruction for nodes without AppArmor, where the
    kubelet refuses a pod that asks for a profile it cannot enforce."""
    out = []
    for doc in yaml.safe_load_all((EXAMPLES / example).read_text()):
        if not doc:
            continue
        spec, prefix = doc.get("spec", {}), "/spec"
        if "template" in spec:
            spec, prefix = spec["template"]["spec"], "/spec/template/spec"
        ops = [{"op": "remove", "path": f"{prefix}/{kind}/{i}/securityContext/appArmorProfile"}
               for kind in ("initContainers", "containers")
               for i, c in enumerate(spec.get(kind, []))
               if "appArmorProfile" in (c.get("securityContext") or {})]
        if ops:
            out.append({"target": {"kind": doc["kind"], "name": doc["metadata"]["name"]},
                        "patch": json.dumps(ops)})
    return out


def example_doc(example: str, kind: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((EXAMPLES / example).read_text()):
        if doc and doc["kind"] == kind:
            d: dict[str, Any] = doc
            return d
    raise LookupError(f"no {kind} in {example}")


def pod_summary(pod: dict[str, Any]) -> str:
    st = pod.get("status", {})
    conds = ",".join(f"{c['type']}={c['status']}" for c in st.get("conditions", []))
    waits = []
    for c in st.get("containerStatuses", []):
        state: dict[str, dict[str, Any]] = c.get("state", {})
        for name, detail in state.items():
            reason = detail.get("reason")
            waits.append(f"{c['name']}:{name}" + (f"({reason})" if reason else ""))
    return (f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']} "
            f"phase={st.get('phase')} {conds} containers={waits} ip={st.get('podIP')}")


def events_text(api: Api, namespace: str, name: str) -> str:
    return "\n".join(f"  {e.get('type')} {e.get('reason')}: {e.get('message')}"
                     for e in api.events(namespace, name))


def wait_pod(api: Api, namespace: str, name: str, cond: Callable[[dict[str, Any]], bool],
             what: str, *, timeout: float = 120) -> dict[str, Any]:
    def seen() -> dict[str, Any] | None:
        pods = [p for p in api.pods(namespace) if p["metadata"]["name"] == name]
        if pods and pods[0].get("status", {}).get("phase") == "Failed":
            raise AssertionError(f"{pod_summary(pods[0])} failed\n"
                                 + events_text(api, namespace, name))
        return pods[0] if pods and cond(pods[0]) else None

    def detail() -> str:
        pods = [p for p in api.pods(namespace) if p["metadata"]["name"] == name]
        return ((pod_summary(pods[0]) if pods else f"no pod {namespace}/{name}")
                + "\nevents:\n" + events_text(api, namespace, name))

    pod: dict[str, Any] = wait_for(seen, timeout, f"pod {namespace}/{name} {what}",
                                   interval=0.5, detail=detail)
    return pod


def wait_ready(api: Api, namespace: str, name: str, timeout: float = 120) -> dict[str, Any]:
    return wait_pod(api, namespace, name, pod_ready, "Ready", timeout=timeout)


def wait_gone(api: Api, namespace: str, name: str, timeout: float = 90) -> None:
    wait_for(lambda: all(p["metadata"]["name"] != name for p in api.pods(namespace)),
             timeout, f"pod {namespace}/{name} to be gone", interval=0.5)


def daemonset_pod(api: Api, namespace: str, selector: str,
                  not_uid: str | None = None, timeout: float = 120) -> dict[str, Any]:
    """The DaemonSet's one pod on the node, Ready (and not the one with uid not_uid)."""
    def seen() -> dict[str, Any] | None:
        pods = [p for p in api.pods(namespace, selector)
                if p["metadata"]["uid"] != not_uid and "deletionTimestamp" not in p["metadata"]]
        return pods[0] if len(pods) == 1 and pod_ready(pods[0]) else None

    pod: dict[str, Any] = wait_for(
        seen, timeout, f"one Ready pod of {selector} in {namespace}", interval=0.5,
        detail=lambda: "\n".join(pod_summary(p) for p in api.pods(namespace, selector)))
    return pod


def delete_pod(kubectl: Kubectl, api: Api, namespace: str, name: str) -> None:
    # The examples' `sleep infinity` ignores SIGTERM: do not wait out the grace period.
    kubectl("-n", namespace, "delete", "pod", name, "--ignore-not-found", "--grace-period=1",
            "--wait=false")
    wait_gone(api, namespace, name)


def exec_in(kubectl: Kubectl, namespace: str, pod: str, script: str,
            container: str | None = None) -> str:
    args = ["-n", namespace, "exec", pod]
    if container:
        args += ["-c", container]
    r = kubectl.run(*args, "--", "/bin/sh", "-c", script, check=False, timeout=60)
    return (r.stdout + r.stderr).strip()


def plugin_env(api: Api) -> list[dict[str, Any]]:
    ds = api.get(f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets/{PLUGIN_DS}")
    env: list[dict[str, Any]] = ds["spec"]["template"]["spec"]["containers"][0].get("env", [])
    return env


def rollout(kubectl: Kubectl, ds: str) -> str:
    return kubectl("-n", PLUGIN_NS, "rollout", "status", f"daemonset/{ds}", "--timeout=180s",
                   timeout=200).strip()


def wait_mounted(kubectl: Kubectl, api: Api, pod: str, mountpoint: str, fstype: str, *,
                 namespace: str = EXAMPLES_NS) -> str:
    """Wait until the pod's container has its FUSE mount; returns its /proc/mounts line
    (not the volume's beneath it)."""
    def seen() -> str | None:
        p = [x for x in api.pods(namespace) if x["metadata"]["name"] == pod]
        if not p or p[0].get("status", {}).get("phase") != "Running":
            return None
        out = exec_in(kubectl, namespace, pod, f"grep ' {mountpoint} ' /proc/mounts")
        return "\n".join(ln for ln in out.splitlines() if f" {fstype} " in ln) or None

    def detail() -> str:
        p = [x for x in api.pods(namespace) if x["metadata"]["name"] == pod]
        logs = kubectl.run("-n", namespace, "logs", pod, "--tail=20", check=False)
        return ((pod_summary(p[0]) if p else f"no pod {pod}") + "\nlogs:\n"
                + (logs.stdout + logs.stderr) + "\n"
                + json.dumps([e.get("message") for e in api.events(namespace, pod)]))

    line: str = wait_for(seen, 120, f"{fstype} mounted at {mountpoint} in {pod}", interval=1,
                         detail=detail)
    return line


def seccomp_seen(kubectl: Kubectl, api: Api, pod: str,
                 namespace: str = EXAMPLES_NS) -> tuple[dict[str, str], str]:
    """The seccomp profile the stored pod names, and the kernel's `Seccomp:` line for its
    container (2: a filter is on)."""
    p = next(x for x in api.pods(namespace) if x["metadata"]["name"] == pod)
    profile: dict[str, str] = p["spec"]["containers"][0]["securityContext"]["seccompProfile"]
    return profile, exec_in(kubectl, namespace, pod, "grep ^Seccomp: /proc/self/status")



def fuse_pod(name: str, image: str, namespace: str) -> dict[str, Any]:
    """A pod asking for `github.com/fuse: 1` that checks it got /dev/fuse and stays."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "c", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", "test -c /dev/fuse && exec sleep 3600"],
                "resources": {"limits": {RESOURCE: "1"}},
            }],
        },
    }


def device_check_pod(name: str, image: str, namespace: str) -> dict[str, Any]:
    """A pod asking for `github.com/fuse: 1` that ends at once, `Succeeded` if it has
    /dev/fuse."""
    pod = fuse_pod(name, image, namespace)
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "test -c /dev/fuse"]
    return pod


def _timestamp(text: str) -> float:
    """An API timestamp (RFC 3339, UTC) in seconds since the epoch."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class PodEverySecond(Repeating):
    """A pod asking for `github.com/fuse: 1` created every second in ``namespace`` on a
    thread (through the API, no kubectl process each), each ending at once: by default
    once it has seen /dev/fuse; ``make`` (name -> pod) gives pods that do more, such as
    mount, and end."""

    def __init__(self, api: Api, image: str, namespace: str,
                 make: Callable[[str], dict[str, Any]] | None = None) -> None:
        super().__init__(1.0, "pods")
        self.api, self.image, self.namespace = api, image, namespace
        self.make = make or (lambda name: device_check_pod(name, image, namespace))
        self.names: list[str] = []
        self.errors: list[str] = []
        self.created: dict[str, str] = {}
        self.ended: dict[str, dict[str, Any]] = {}

    def step(self) -> None:
        name = f"roll-{len(self.names)}"
        try:
            self.api.request("POST", f"/api/v1/namespaces/{self.namespace}/pods",
                             self.make(name))
            self.names.append(name)
        except OSError as err:  # urllib's HTTPError and URLError are OSErrors
            self.errors.append(f"{name}: {err}")

    def phases(self) -> dict[str, dict[str, Any]]:
        """Every pod's status once it has ended (Succeeded or Failed)."""
        def ended() -> dict[str, dict[str, Any]] | None:
            pods = {p["metadata"]["name"]: p for p in self.api.pods(self.namespace)}
            done = {n: {**p["status"], "nodeName": p["spec"].get("nodeName")}
                    for n, p in pods.items()
                    if p["status"].get("phase") in ("Succeeded", "Failed")}
            self.created = {n: p["metadata"]["creationTimestamp"] for n, p in pods.items()}
            return done if set(self.names) <= set(done) else None
        found: dict[str, dict[str, Any]] = wait_for(
            ended, 180, f"the {len(self.names)} rollout pods to end", interval=1,
            detail=lambda: "\n".join(pod_summary(p) for p in self.api.pods(self.namespace)))
        self.ended = found
        return found

    def longest_wait(self) -> str:
        """After ``phases()``: the pod that waited longest from its creation to its
        container's start, as a line (the API's timestamps are whole seconds)."""
        waits: dict[str, float] = {}
        for name, status in self.ended.items():
            for c in status.get("containerStatuses") or []:
                started = (c.get("state", {}).get("terminated") or {}).get("startedAt")
                if started and name in self.created:
                    waits[name] = (_timestamp(started) - _timestamp(self.created[name]))
        if not waits:
            return "longest wait of a new pod: none started"
        name = max(waits, key=lambda n: waits[n])
        median = statistics.median(waits.values())
        return (f"longest wait of a new pod (created to its container started, whole "
                f"seconds): {name} {waits[name]:.0f} s; median {median:.0f} s")


# ---------------------------------------------------------------- rollouts with pods


def node_names(api: Api) -> list[str]:
    """The cluster's nodes, by name."""
    return sorted(n["metadata"]["name"] for n in api.get("/api/v1/nodes")["items"])


def pods_by_node(api: Api, namespace: str, selector: str = "",
                 nodes: list[str] | None = None) -> dict[str, list[str]]:
    """Names of the live pods (not being deleted) on each node (``nodes``: the API's)."""
    out: dict[str, list[str]] = {n: [] for n in (nodes or node_names(api))}
    for p in api.pods(namespace, selector):
        node = p["spec"].get("nodeName")
        if node in out and "deletionTimestamp" not in p["metadata"]:
            out[node].append(p["metadata"]["name"])
    return out


def one_ready_per_node(api: Api, selector: str) -> dict[str, dict[str, Any]]:
    """The DaemonSet's one Ready pod on each node."""
    nodes = set(node_names(api))

    def seen() -> dict[str, dict[str, Any]] | None:
        pods = [p for p in api.pods(PLUGIN_NS, selector)
                if "deletionTimestamp" not in p["metadata"]]
        by = {p["spec"].get("nodeName"): p for p in pods if pod_ready(p)}
        return by if len(pods) == len(nodes) and set(by) == nodes else None

    found: dict[str, dict[str, Any]] = wait_for(
        seen, 120, f"one Ready pod of {selector} on each node", interval=0.5,
        detail=lambda: "\n".join(pod_summary(p) + f" node={p['spec'].get('nodeName')}"
                                 for p in api.pods(PLUGIN_NS, selector)))
    return found


class PluginPodsSampler(Repeating):
    """A DaemonSet's live pods on each node (the plugin's unless ``selector`` says),
    sampled every 200 ms on a thread: how many existed at once, and on how many nodes two
    did (a node surging)."""

    def __init__(self, api: Api, selector: str = PLUGIN_SELECTOR) -> None:
        super().__init__(0.2, "sampler")
        self.api, self.selector = api, selector
        self.nodes = node_names(api)
        self.samples: list[dict[str, list[str]]] = []

    def step(self) -> None:
        with contextlib.suppress(OSError):  # a slow answer: the next sample
            self.samples.append(pods_by_node(self.api, PLUGIN_NS, self.selector, self.nodes))

    def surging_at_once(self) -> int:
        """The most nodes that had two plugin pods in one sample."""
        return max((sum(len(v) > 1 for v in s.values()) for s in self.samples), default=0)

    def replaced(self) -> list[str]:
        """The nodes in the order their pods first differed from the first sample's."""
        first = self.samples[0] if self.samples else {}
        seen: list[str] = []
        for s in self.samples:
            seen += [n for n, v in s.items() if v != first.get(n) and n not in seen]
        return seen

    def most_without(self) -> int:
        """The most nodes that had no pod in one sample."""
        return max((sum(not v for v in s.values()) for s in self.samples), default=0)

    def order(self) -> list[str]:
        """The nodes in the order their surge began."""
        seen: list[str] = []
        for s in self.samples:
            seen += [n for n, v in s.items() if len(v) > 1 and n not in seen]
        return seen


class FollowedLogs:
    """`kubectl logs -f` of a DaemonSet's pods as they are when entered, to their end:
    what the old pods of a rollout said while they stopped (their logs go with them)."""

    def __init__(self, kubectl: Kubectl, api: Api, selector: str) -> None:
        self.kubectl, self.api, self.selector = kubectl, api, selector
        self._dir = Path(tempfile.mkdtemp(prefix="fdp-logs-"))
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, str] = {}

    def __enter__(self) -> FollowedLogs:
        for pod in self.api.pods(PLUGIN_NS, self.selector):
            name = pod["metadata"]["name"]
            with open(self._dir / name, "wb") as out:
                self._procs[name] = subprocess.Popen(
                    [self.kubectl.binary, f"--kubeconfig={self.kubectl.kubeconfig}", "-n",
                     PLUGIN_NS, "logs", "-f", "--tail=5", name],
                    stdout=out, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, proc in self._procs.items():
            try:
                proc.wait(FOLLOW_END)  # the pod is gone: its stream ends
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.logs[name] = (self._dir / name).read_text(errors="replace")
        shutil.rmtree(self._dir, ignore_errors=True)

    def lines(self, *words: str) -> list[str]:
        """The followed pods' lines that hold one of ``words``, each after its pod's name."""
        return [f"{name}: {line}" for name, text in self.logs.items()
                for line in text.splitlines() if any(w in line for w in words)]


class Restarted(NamedTuple):
    status: str  # `kubectl rollout status`'s last line
    new: dict[str, dict[str, Any]]  # the DaemonSet's Ready pod on each node, after
    took: float  # seconds from `rollout restart` to a new Ready pod on each node
    sampler: PluginPodsSampler  # the DaemonSet's pods per node through it
    old: FollowedLogs  # what the replaced pods logged to their end


def restart_with_pods(kubectl: Kubectl, api: Api, stream: PodEverySecond, ds: str,
                      selector: str) -> Restarted:
    """`kubectl rollout restart` of the DaemonSet ``ds`` (pods ``selector``) while
    ``stream`` creates a pod every second: three before it, through it, three after."""
    with stream, PluginPodsSampler(api, selector) as sampler, \
            FollowedLogs(kubectl, api, selector) as old:
        wait_for(lambda: len(stream.names) >= 3, 30, "three pods before the rollout")
        began = time.monotonic()
        kubectl("-n", PLUGIN_NS, "rollout", "restart", f"daemonset/{ds}")
        status = rollout(kubectl, ds)
        new = one_ready_per_node(api, selector)
        took = time.monotonic() - began
        after = len(stream.names) + 3
        wait_for(lambda: len(stream.names) >= after, 30, "three pods after the rollout")
    return Restarted(status, new, took, sampler, old)
