"""Pod start per mode on the cluster stage's node (issue 35): how much later a pod that
mounts FUSE is up than one that does not, in the default mode, broker mode and DRA.

Run from the repository root, as root, with the cluster stage's caches in place
(``tests/cluster/setup.sh all``; it takes the stage's lock, so not during a cluster run)::

    .venv/bin/python -m bench.pod_start             # 40 + 40 pods in each mode
    .venv/bin/python -m bench.pod_start --pods 4    # a quick look

For each mode the manifests are applied as the README deploys them (``manifests/``; with
``components: [broker]``; with the DRA component and the plugin's DaemonSet deleted;
``dra-claim``: the same, its FUSE pods naming a ResourceClaimTemplate of the FUSE class
instead of the extended resource), then ``--pods`` FUSE pods and as many without FUSE
are created at once, alternately, through the API. Both kinds run the rootless-build
example's image and the same script; a FUSE pod asks for ``github.com/fuse: 1`` and
mounts fuse-overlayfs before it writes the time (default mode and DRA: CAP_SYS_ADMIN;
broker mode: no capability, the mount made by the broker through the shim), a plain pod
writes the time at once. A pod's figure is that time minus its POST's. Over the burst,
the CPU time and the largest RSS of the broker's and the driver's (and the plugin's) pod
cgroups. Prints a table; writes JSON (``bench/results/pod_start.json`` or ``--out``). No
targets: the figures are in bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.run import summary, write_report
from tests.cluster.cluster import Api, Cluster, Kubectl, find_kubectl
from tests.cluster.kube import (
    APPLY,
    DEFAULT_SLOTS,
    PLUGIN_DS,
    PLUGIN_NS,
    RESOURCE,
    fuse_resources,
    manifests_overlay,
    rollout,
    wait_allocatable,
    write_json,
)
from tests.cluster.test_cluster_dra import DRIVER_DS, driver_overlay, prepare_waits
from tests.kubelet.node import wait_for
from tests.lib.background import Repeating

RESULTS = Path(__file__).parent / "results" / "pod_start.json"
SETUP = Path(__file__).resolve().parents[1] / "tests" / "cluster" / "setup.sh"
NS = "fdp-bench-pod-start"
MODES = ("default", "broker", "dra", "dra-claim")
DRA_MODES = ("dra", "dra-claim")
# dra-claim's pods name a ResourceClaimTemplate of the FUSE class instead of the extended
# resource: their claims exist before they are scheduled.
CLAIM_TEMPLATE = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
    "metadata": {"name": "fuse", "namespace": NS},
    "spec": {"spec": {"devices": {"requests": [
        {"name": "fuse", "exactly": {"deviceClassName": "fuse.fuse-device-plugin.github.com"}}]}}}}
BROKER_DS = "fuse-mount-broker"
# The component pods whose cgroups are read over the burst, by their label.
COMPONENTS = {"plugin": "app.kubernetes.io/component=device-plugin",
              "broker": "app.kubernetes.io/component=mount-broker",
              "driver": "app.kubernetes.io/component=dra-driver"}
CGROUP = Path("/sys/fs/cgroup")
MOUNT = ("mkdir -p /tmp/l /tmp/u /tmp/w /tmp/m"
         " && fuse-overlayfs -o lowerdir=/tmp/l,upperdir=/tmp/u,workdir=/tmp/w /tmp/m"
         " && grep -q ' /tmp/m fuse' /proc/mounts && ")
STAMP = "date +%s.%N > /dev/termination-log"


def overlay(tmp: Path, mode: str, image: str) -> Path:
    """The kustomization the README applies for ``mode``."""
    base = manifests_overlay(tmp, image)
    if mode == "broker":
        k = json.loads((base / "kustomization.yaml").read_text())
        k["components"] = [*k.get("components", []), "broker"]
        write_json(base / "kustomization.yaml", k)
    return driver_overlay(base, image) if mode in DRA_MODES else base


def deploy(kubectl: Kubectl, api: Api, mode: str, tmp: Path, image: str) -> None:
    kubectl(*APPLY, "-k", str(overlay(tmp / mode, mode, image)))
    if mode in DRA_MODES:
        # The component deletes it itself; a plugin left from before goes too.
        kubectl("-n", PLUGIN_NS, "delete", "daemonset", PLUGIN_DS, "--ignore-not-found",
                "--wait=true")
        rollout(kubectl, DRIVER_DS)
        # Until the API shows the node's allocatable 0, the scheduler sends the device
        # plugin's way, which is gone (docs/dra.md, "Switching").
        wait_for(lambda: fuse_resources(api)[1] in (0, None) or None, 120,
                 "the node's allocatable github.com/fuse to be 0", interval=1)
        return
    rollout(kubectl, PLUGIN_DS)
    if mode == "broker":
        rollout(kubectl, BROKER_DS)
    wait_allocatable(api, DEFAULT_SLOTS)


def undeploy(kubectl: Kubectl, mode: str, tmp: Path, image: str) -> None:
    kubectl("delete", "-k", str(overlay(tmp / f"{mode}-delete", mode, image)),
            "--ignore-not-found", "--wait=true", timeout=300)


def pod(name: str, image: str, mode: str, fuse: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "c", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["/bin/sh", "-c", (MOUNT if fuse else "") + STAMP]}
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "automountServiceAccountToken": False,
        "enableServiceLinks": False, "terminationGracePeriodSeconds": 1,
        "containers": [container]}
    if fuse and mode == "dra-claim":
        container["resources"] = {"claims": [{"name": "fuse"}]}
        spec["resourceClaims"] = [{"name": "fuse", "resourceClaimTemplateName": "fuse"}]
    elif fuse:
        container["resources"] = {"limits": {RESOURCE: "1"}}
    if fuse and mode != "broker":
        container["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"fuse": str(fuse).lower()}},
            "spec": spec}


def pod_cgroup(uid: str, controller: str) -> Path | None:
    """The pod's cgroup directory in a v1 hierarchy: kubepods/pod<uid> (Guaranteed) or
    kubepods/<qos>/pod<uid>."""
    base = CGROUP / controller / "kubepods"
    found = [d for d in (base / f"pod{uid}", base / "burstable" / f"pod{uid}",
                         base / "besteffort" / f"pod{uid}") if d.is_dir()]
    return found[0] if found else None


class Usage(Repeating):
    """CPU time and largest RSS of the component pods, sampled every 200 ms."""

    def __init__(self, api: Api) -> None:
        self.pods: dict[str, str] = {}
        for name, selector in COMPONENTS.items():
            found = [p for p in api.pods(PLUGIN_NS, selector)
                     if "deletionTimestamp" not in p["metadata"]]
            if found:
                self.pods[name] = found[0]["metadata"]["uid"]
        self.cpu0 = {n: self.cpu_ns(u) for n, u in self.pods.items()}
        self.rss = dict.fromkeys(self.pods, 0)
        super().__init__(0.2, "usage", join_timeout=10)

    @staticmethod
    def cpu_ns(uid: str) -> int:
        d = pod_cgroup(uid, "cpuacct")
        return int((d / "cpuacct.usage").read_text()) if d else 0

    @staticmethod
    def rss_bytes(uid: str) -> int:
        d = pod_cgroup(uid, "memory")
        if d is None:
            return 0
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        return int(stat.get("total_rss", 0))

    def step(self) -> None:
        for n, u in self.pods.items():
            with contextlib.suppress(OSError):  # a pod restarting: the next sample
                self.rss[n] = max(self.rss[n], self.rss_bytes(u))

    def figures(self) -> dict[str, dict[str, float]]:
        return {n: {"cpu_s": round((self.cpu_ns(u) - self.cpu0[n]) / 1e9, 3),
                    "max_rss_mib": round(self.rss[n] / 2**20, 1)}
                for n, u in self.pods.items()}


def burst(api: Api, image: str, mode: str, count: int) -> dict[str, Any]:
    """``count`` FUSE and ``count`` plain pods created at once, alternately; each one's
    start (its written time minus its POST's), by kind."""
    api.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": NS}})
    if mode == "dra-claim":
        api.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates",
                    CLAIM_TEMPLATE)
    posted: dict[str, float] = {}
    with Usage(api) as usage:
        for i in range(count):
            for with_fuse in (True, False):
                name = f"{'fuse' if with_fuse else 'plain'}-{i}"
                posted[name] = time.time()
                api.request("POST", f"/api/v1/namespaces/{NS}/pods",
                            pod(name, image, mode, with_fuse))

        def ended() -> list[dict[str, Any]] | None:
            over = [p for p in api.pods(NS) if p["status"].get("phase") in ("Succeeded", "Failed")]
            return over if len(over) == len(posted) else None

        done: list[dict[str, Any]] = wait_for(ended, 900, f"the {len(posted)} pods to end",
                                              interval=1)
    failed = [p["metadata"]["name"] for p in done if p["status"]["phase"] != "Succeeded"]
    starts: dict[str, list[float]] = {"fuse": [], "plain": []}
    for p in done:
        name = p["metadata"]["name"]
        if name in failed:
            continue
        msg = p["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
        starts[name.split("-")[0]].append(float(msg) - posted[name])
    fuse, plain = summary(starts["fuse"]), summary(starts["plain"])
    by_claim = sum(bool(p["status"].get("extendedResourceClaimStatus")
                        or p["status"].get("resourceClaimStatuses")) for p in done)
    # A prepare the kubelet retried delays its pod by the retry's back-off: whose it was.
    driver, lag = prepare_waits(api, NS, [p["metadata"]["name"] for p in done])
    return {"fuse": fuse, "plain": plain, "failed": failed, "by_dra_claim": by_claim,
            "prepare_retried": {"driver": len(driver), "authorizer_lag": len(lag),
                                "first": (driver + lag)[:3]},
            "ratio_p50": round(fuse["median_ms"] / plain["median_ms"], 3),
            "ratio_p99": round(fuse["p99_ms"] / plain["p99_ms"], 3),
            "components": usage.figures()}


def delete_namespace(api: Api) -> None:
    api.request("DELETE", f"/api/v1/namespaces/{NS}")
    wait_for(lambda: not any(n["metadata"]["name"] == NS
                             for n in api.get("/api/v1/namespaces")["items"]),
             300, f"namespace {NS} to be gone", interval=1)


def measure(count: int, modes: Sequence[str]) -> dict[str, Any]:
    cluster = Cluster()
    figures: dict[str, Any] = {}
    try:
        # With the lock held: another worktree's set-up may have recorded its images.
        r = subprocess.run([str(SETUP), "all"], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{SETUP} all failed:\n{r.stderr[-2000:]}")
        cluster.read_images()
        found = find_kubectl()
        if isinstance(found, str):
            raise RuntimeError(found)
        cluster.up()
        kubectl = Kubectl(found[0], cluster.admin_kubeconfig)
        images = {**cluster.images, **cluster.cluster_images}
        plugin, tool = images["PLUGIN_IMAGE"], images["EXAMPLE_BUILDAH_IMAGE"]
        tmp = Path(tempfile.mkdtemp(prefix="fdp-pod-start-"))
        for mode in modes:
            deploy(kubectl, cluster.api, mode, tmp, plugin)
            try:
                figures[mode] = burst(cluster.api, tool, mode, count)
            finally:
                delete_namespace(cluster.api)
                undeploy(kubectl, mode, tmp, plugin)
            print(f"{mode}: {json.dumps(figures[mode])}", file=sys.stderr)
    finally:
        cluster.down()
        cluster.unlock()
    return figures


def table(figures: dict[str, Any]) -> str:
    rows = [f"{'mode':<8} {'FUSE p50/p99':>16} {'plain p50/p99':>16} {'ratio p50/p99':>14} "
            f"{'failed':>6} {'by claim':>8}  components over the burst (CPU s, max RSS MiB)"]
    for mode, f in figures.items():
        comps = ", ".join(f"{n} {c['cpu_s']:.2f} s {c['max_rss_mib']:.0f} MiB"
                          for n, c in f["components"].items())
        fuse, plain = (f"{f[k]['median_ms'] / 1000:.2f}/{f[k]['p99_ms'] / 1000:.2f} s"
                       for k in ("fuse", "plain"))
        ratios = f"{f['ratio_p50']:.2f}/{f['ratio_p99']:.2f}"
        rows.append(f"{mode:<8} {fuse:>16} {plain:>16} {ratios:>14} {len(f['failed']):>6} "
                    f"{f.get('by_dra_claim', 0):>8}  {comps}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pod_start",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=40,
                        help="FUSE pods per burst, and as many plain ones (40)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON path ({RESULTS})")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    wrong = [m for m in modes if m not in MODES]
    if wrong or not modes:
        print(f"bench.pod_start: unknown mode(s) {wrong}; choose from {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    if not 1 <= args.pods <= 50:
        print("bench.pod_start: --pods must be 1..50 (twice that many pods share the "
              "node's 110 and its pod range)", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench.pod_start: needs root (it runs the cluster stage)", file=sys.stderr)
        return 2
    began = time.monotonic()
    try:
        figures = measure(args.pods, modes)
    except RuntimeError as err:
        print(f"bench.pod_start: {err}", file=sys.stderr)
        return 1
    result = {"pods": args.pods, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.monotonic() - began, 1),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "loadavg": os.getloadavg()},
              "figures": figures}
    write_report(args.out, result, table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
