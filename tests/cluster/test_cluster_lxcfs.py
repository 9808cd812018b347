"""LXCFS views through the broker in the one-machine cluster (issue 36): the broker
component deployed as the README says (it brings the node's lxcfs DaemonSet), and two
consumers written as the README's pod snippet: a `restricted` pod (uid 1000, no
capability) and a `hostUsers: false` one, each starting its command through
`fusermount3 --lxcfs --`. Their `free -m`, the CPUs glibc counts (`getconf
_NPROCESSORS_ONLN`, which reads /sys/devices/system/cpu/online) and `/proc/uptime` are
their own; `nproc` is printed too (it counts the CPUs the process may run on, its
affinity, which no file changes). Then lxcfs is restarted three ways while both read in
a loop (a rollout restart, a SIGKILL of lxcfs, the DaemonSet deleted and re-created with
the consumers' binds in place): reads resume, and no pod restarts.

Nothing here depends on the node count: each consumer is asked about its own node's
lxcfs pod (the one on its `spec.nodeName`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.broker import lxcfs
from tests.cluster.cluster import Api, Cluster, Kubectl, pod_ready
from tests.cluster.kube import (
    APPLY,
    BROKER_DS,
    DEFAULT_SLOTS,
    INSTALLER_DS,
    LXCFS_DS,
    PLUGIN_DS,
    PLUGIN_NS,
    RESOURCE,
    evidence,
    exec_in,
    manifests_overlay,
    pod_summary,
    rollout,
    wait_allocatable,
    wait_gone,
    wait_pod,
)
from tests.cluster.test_cluster_broker import edit_add_component, pod_log
from tests.kubelet.node import wait_for
from tests.lib.manifests import restricted_violations

LXCFS_SELECTOR = "app.kubernetes.io/component=lxcfs"
LIMIT_MI = 256
READS = "/dev/shm/reads"
# One read of /proc/meminfo every 0.2 s, numbered, with its outcome: the evidence of
# when reads stopped and resumed, without a restart (the numbers go on).
READER = (f"i=0; while :; do i=$((i+1)); if v=$(grep MemTotal /proc/meminfo 2>&1); "
          f"then echo \"$i $(date +%s.%N) ok $v\"; else echo \"$i $(date +%s.%N) fail $v\"; "
          f"fi; sleep 0.2; done > {READS}")
CONSUMERS = {"lxcfs-restricted": "restricted", "lxcfs-userns": "baseline"}


def consumer_pod(namespace: str, image: str) -> dict[str, Any]:
    """The README's snippet: `github.com/fuse: 1`, the command through the shim."""
    userns = namespace == "lxcfs-userns"
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}}
    pod_context: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if not userns:
        pod_context.update(runAsNonRoot=True, runAsUser=1000, runAsGroup=1000)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "views", "namespace": namespace},
        "spec": {
            **({"hostUsers": False} if userns else {}),
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 2, "securityContext": pod_context,
            "containers": [{
                "name": "work", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["fusermount3", "--lxcfs", "--", "sh", "-c", READER],
                "securityContext": context,
                # Requests below the limits: two pods fit a 2-CPU node beside ours.
                "resources": {"limits": {RESOURCE: 1, "cpu": "1",
                                         "memory": f"{LIMIT_MI}Mi"},
                              "requests": {"cpu": "100m", "memory": "32Mi"}},
            }],
        },
    }


def lxcfs_pod(api: Api, node: str, not_uid: str | None = None,
              timeout: float = 120) -> dict[str, Any]:
    """The Ready lxcfs pod on ``node`` (not the one with uid ``not_uid``)."""
    def seen() -> dict[str, Any] | None:
        pods = [p for p in api.pods(PLUGIN_NS, LXCFS_SELECTOR)
                if p["spec"].get("nodeName") == node and p["metadata"]["uid"] != not_uid
                and "deletionTimestamp" not in p["metadata"] and pod_ready(p)]
        return pods[0] if pods else None
    found: dict[str, Any] = wait_for(seen, timeout, f"a Ready lxcfs pod on {node}",
                                     interval=0.5)
    return found


def lxcfs_restarts(api: Api, node: str) -> int:
    """The restarts of the lxcfs container on ``node`` (its current pod)."""
    return sum(int(s["restartCount"]) for p in api.pods(PLUGIN_NS, LXCFS_SELECTOR)
               if p["spec"].get("nodeName") == node and "deletionTimestamp" not in p["metadata"]
               for s in p.get("status", {}).get("containerStatuses", []))


def reads(kubectl: Kubectl, namespace: str) -> list[tuple[int, float, bool, str]]:
    out = exec_in(kubectl, namespace, "views", f"cat {READS}")
    rows = []
    for line in out.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0].isdigit():
            rows.append((int(parts[0]), float(parts[1]), parts[2] == "ok", parts[3]))
    return rows


def resumed_after(kubectl: Kubectl, namespace: str, since: float
                  ) -> tuple[int, float, bool, str] | None:
    """The first good read after the last failed one since ``since`` (None yet)."""
    rows = [r for r in reads(kubectl, namespace) if r[1] >= since]
    failed = [r for r in rows if not r[2]]
    after = [r for r in rows if r[2] and (not failed or r[0] > failed[-1][0])]
    return after[0] if failed and after else None


def diagnosis(kubectl: Kubectl, api: Api, namespace: str) -> str:
    """What a failure message needs: the consumer (its log is the shim's stderr), its
    reads, the lxcfs pods' logs and the broker's lxcfs lines."""
    out = [pod_summary(p) for p in api.pods(namespace)]
    out += ["consumer log:", pod_log(kubectl, namespace, "views")[-2000:],
            "reads:", exec_in(kubectl, namespace, "views", f"tail -3 {READS}")]
    for p in api.pods(PLUGIN_NS, LXCFS_SELECTOR):
        out += [pod_summary(p), pod_log(kubectl, PLUGIN_NS, p["metadata"]["name"])[-3000:]]
    for p in api.pods(PLUGIN_NS, "app.kubernetes.io/component=mount-broker"):
        out += [line for line in pod_log(kubectl, PLUGIN_NS, p["metadata"]["name"])
                .splitlines() if "lxcfs" in line][-20:]
    return "\n".join(out)


def restarts(api: Api, namespace: str) -> int:
    [pod] = [p for p in api.pods(namespace) if p["metadata"]["name"] == "views"]
    return int(pod["status"]["containerStatuses"][0]["restartCount"])


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def views_overlay(tmp_path_factory: pytest.TempPathFactory, images: dict[str, str]) -> Path:
    """README "Broker mode", Deploy: manifests/ with the image set and the broker
    component added (it brings the lxcfs DaemonSet)."""
    overlay = manifests_overlay(tmp_path_factory.mktemp("lxcfs-overlay"),
                                images["PLUGIN_IMAGE"])
    edit_add_component(overlay, "broker")
    return overlay


@pytest.fixture(scope="module")
def consumers(cluster: Cluster, kubectl: Kubectl, api: Api, views_overlay: Path,
              images: dict[str, str]) -> Iterator[dict[str, dict[str, Any]]]:
    kubectl(*APPLY, "-k", str(views_overlay))
    for ds in (BROKER_DS, PLUGIN_DS, INSTALLER_DS, LXCFS_DS):
        try:
            rollout(kubectl, ds)
        except AssertionError as err:  # say why: the pods and their last lines
            raise AssertionError("\n".join([str(err), *(
                f"{pod_summary(p)}\n{pod_log(kubectl, PLUGIN_NS, p['metadata']['name'])[-1500:]}"
                for p in api.pods(PLUGIN_NS))])) from None
    wait_allocatable(api, DEFAULT_SLOTS)
    pods = {}
    try:
        for namespace, level in CONSUMERS.items():
            kubectl(*APPLY, "-f", "-", stdin=(
                f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n"
                f"  labels:\n    pod-security.kubernetes.io/enforce: {level}\n"))
            kubectl(*APPLY, "-f", "-", stdin=json.dumps(consumer_pod(
                namespace, images["EXAMPLE_LXCFS_IMAGE"])))
        for namespace in CONSUMERS:
            pods[namespace] = wait_pod(api, namespace, "views", pod_ready, "Ready")
            wait_for(lambda ns=namespace: any(r[2] for r in reads(kubectl, ns)),  # type: ignore[misc]
                     120, f"{namespace}: a first read",
                     detail=lambda ns=namespace: diagnosis(kubectl, api, ns))  # type: ignore[misc]
        yield pods
    finally:
        for namespace in CONSUMERS:
            kubectl.run("delete", "namespace", namespace, "--wait=false", check=False)
        for namespace in CONSUMERS:
            wait_gone(api, namespace, "views")


# ---------------------------------------------------------------- tests


def test_restricted_and_userns_pods_see_their_own_limits(
        consumers: dict[str, dict[str, Any]], kubectl: Kubectl, api: Api) -> None:
    lines: list[str] = []
    checks: list[str] = []
    host_uptime = float(Path("/proc/uptime").read_text().split()[0])
    for namespace, pod in consumers.items():
        out = exec_in(kubectl, namespace, "views",
                      "free -m | sed -n 2p; echo getconf=$(getconf _NPROCESSORS_ONLN); "
                      "echo nproc=$(nproc); echo cpuinfo=$(grep -c ^processor /proc/cpuinfo);"
                      " echo uptime=$(cut -d' ' -f1 /proc/uptime); "
                      "grep -E '^(CapEff|Uid):' /proc/self/status; "
                      "grep -c ' - fuse.lxcfs ' /proc/self/mountinfo")
        stored = pod["spec"]
        lines += [f"{namespace} ({CONSUMERS[namespace]}, hostUsers="
                  f"{stored.get('hostUsers', True)}, restricted violations: "
                  f"{restricted_violations({**pod, 'kind': 'Pod'}) or 'none'}):", *out.splitlines()]
        checks.append(out)
    proof = evidence("lxcfs-views", f"node uptime {host_uptime:.0f}s", *lines)
    for out in checks:
        mem = re.search(r"^Mem:\s+(\d+)", out, re.MULTILINE)
        assert mem, proof
        assert int(mem[1]) == LIMIT_MI, proof
        assert "getconf=1\n" in out, proof
        assert "cpuinfo=1\n" in out, proof
        uptime = re.search(r"uptime=([\d.]+)", out)
        assert uptime, proof
        assert float(uptime[1]) < host_uptime, proof
        assert "CapEff:\t0000000000000000" in out, proof
        assert out.strip().endswith(str(len(lxcfs.FILES))), proof
    assert restricted_violations({**consumers["lxcfs-restricted"], "kind": "Pod"}) == [], proof


@pytest.mark.parametrize("how", ["rollout-restart", "sigkill", "delete-and-recreate"])
def test_reads_resume_when_lxcfs_restarts(
        how: str, consumers: dict[str, dict[str, Any]], kubectl: Kubectl, api: Api,
        views_overlay: Path) -> None:
    node = next(iter(consumers.values()))["spec"]["nodeName"]
    old = lxcfs_pod(api, node)
    before = {ns: restarts(api, ns) for ns in consumers}
    lxcfs_restarts_before = lxcfs_restarts(api, node)
    started = time.time()
    if how == "rollout-restart":
        kubectl("-n", PLUGIN_NS, "rollout", "restart", f"daemonset/{LXCFS_DS}")
        rollout(kubectl, LXCFS_DS)
    elif how == "sigkill":
        log = pod_log(kubectl, PLUGIN_NS, old["metadata"]["name"])
        pid = re.findall(r"lxcfs\.mounted .*pid=(\d+)", log)[-1]
        exec_in(kubectl, PLUGIN_NS, old["metadata"]["name"], f"kill -KILL {pid}")
    else:
        kubectl("-n", PLUGIN_NS, "delete", "daemonset", LXCFS_DS, "--wait=true")
        wait_gone(api, PLUGIN_NS, old["metadata"]["name"])
        for namespace in consumers:  # the binds of the dead lxcfs are still in place
            wait_for(lambda ns=namespace: any(not r[2] for r in reads(kubectl, ns)  # type: ignore[misc]
                                              if r[1] >= started),
                     60, f"{namespace}: a failed read with lxcfs gone")
        kubectl(*APPLY, "-k", str(views_overlay))
        rollout(kubectl, LXCFS_DS)
    if how == "sigkill":  # the same pod: its container ends with lxcfs and restarts
        wait_for(lambda: lxcfs_restarts(api, node) > lxcfs_restarts_before, 120,
                 "the lxcfs container to restart")
    new = lxcfs_pod(api, node, not_uid=old["metadata"]["uid"] if how != "sigkill" else None)
    resumed = {}
    for namespace in consumers:
        resumed[namespace] = wait_for(
            lambda ns=namespace: resumed_after(kubectl, ns, started),  # type: ignore[misc]
            90, f"{namespace}: reads to resume after {how}",
            detail=lambda ns=namespace: diagnosis(kubectl, api, ns))  # type: ignore[misc]
    after = {ns: restarts(api, ns) for ns in consumers}
    rows = {ns: [r for r in reads(kubectl, ns) if r[1] >= started] for ns in consumers}
    proof = evidence(
        f"lxcfs-{how}", f"old lxcfs pod {pod_summary(old)}", f"new {pod_summary(new)}",
        *(f"{ns}: first failed read {next((r for r in rows[ns] if not r[2]), None)}; "
          f"resumed {resumed[ns]} ({resumed[ns][1] - started:.1f}s after the restart "
          f"began); restarts {before[ns]} -> {after[ns]}" for ns in consumers))
    for namespace in consumers:
        assert f"{LIMIT_MI * 1024} kB" in resumed[namespace][3], proof
        assert after[namespace] == before[namespace], proof
