"""Switching a node from the device plugin to the DRA driver and back, as docs/dra.md's
"Switching" says, with a FUSE pod reading its sshfs mount every 200 ms throughout: its
reads never fail, a FUSE pod created every second through the switch to DRA is never
rejected (the nodes cordoned while the plugin goes, as the docs say), new pods are served
by whichever path is current, the node never
serves `github.com/fuse` from both at once, and after the way back nothing of the driver
is left (no stuck pod, no CDI spec). A cluster of its own: it starts from the device
plugin, where test_cluster_dra starts from the driver."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.cluster import Api, Kubectl
from tests.cluster.kube import (
    APPLY,
    DEFAULT_SLOTS,
    EXAMPLES_NS,
    PLUGIN_DS,
    PLUGIN_NS,
    PodEverySecond,
    delete_pod,
    evidence,
    exec_in,
    fuse_resources,
    rollout,
    wait_allocatable,
    wait_mounted,
    wait_ready,
)
from tests.cluster.servers import NAMESPACE as SERVERS_NS
from tests.cluster.servers import Servers
from tests.cluster.sshfs_example import SSHFS_POD, apply_sshfs_example, delete_sshfs_example
from tests.cluster.test_cluster_dra import (
    DRA_NS,
    DRIVER,
    DRIVER_DS,
    apply_fuse_pod,
    claim_specs,
    driver_overlay,
    slices,
)
from tests.kubelet.node import wait_for

# docs/dra.md, "Switching": the commands a user types, word for word. To DRA: the nodes
# that run the plugin (its DaemonSet's nodeSelector) cordoned while the plugin goes, so no
# pod is scheduled onto a node whose allocatable the kubelet has not yet reported as 0.
PLUGIN_NODES = "kubernetes.io/os=linux"
TO_DRA = (
    ("cordon", "-l", PLUGIN_NODES),
    ("-n", "fuse-device-plugin", "delete", "daemonset", "fuse-device-plugin"),
    ("wait", "nodes", "-l", PLUGIN_NODES,
     "--for=jsonpath={.status.allocatable.github\\.com/fuse}=0", "--timeout=3m"),
    ("uncordon", "-l", PLUGIN_NODES),
)
OURS_LEFT = ("get", "resourceclaims", "-A", "-o",
             "jsonpath={range .items[*]}{.status.allocation.devices.results[*].driver}"
             "{\"\\n\"}{end}")
REMOVE_DRIVER = ("delete", "-A", "-l", "app.kubernetes.io/name=fuse-dra-driver",
                 "daemonset,serviceaccount,networkpolicy,deviceclass,clusterrole,"
                 "clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding")
# Where a FUSE pod is created every second through the switch to DRA.
STREAM_NS = "fdp-e2e-dra-switch-stream"
# In /dev/shm: the example's root filesystem is read-only.
READER = ("nohup setsid sh -c 'while :; do if cat /mnt/remote/switch.txt >/dev/null; "
          "then echo ok; else echo FAIL; fi >> /dev/shm/reads; sleep 0.2; done' "
          ">/dev/null 2>&1 &")


def reads(kubectl: Kubectl) -> tuple[int, int]:
    """The reader's (good, failed) reads so far."""
    out = exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, "cat /dev/shm/reads").split()
    return out.count("ok"), out.count("FAIL")


def served_by_dra(pod: dict[str, Any]) -> bool:
    return bool((pod.get("status") or {}).get("extendedResourceClaimStatus"))


def to_dra(kubectl: Kubectl) -> list[str]:
    """docs/dra.md's switch to DRA after `kubectl apply -k` of the component: every
    command's output, each line prefixed with its command's verb."""
    out = []
    for command in TO_DRA:
        verb = next(w for w in command if not w.startswith("-") and w != "fuse-device-plugin")
        out += [f"{verb}: {line}" for line in kubectl(*command, timeout=240).splitlines()]
    return out


@dataclass(frozen=True)
class Switched:
    """What ``to_dra_with_pods`` saw: the commands' output and time, and the pods."""

    lines: list[str]
    took: float
    made: int
    rejected: dict[str, str]  # pod -> why, for pods that did not succeed
    errors: list[str]  # pods the API would not create
    last_by_dra: dict[str, bool]  # the three pods made after the switch
    longest_wait: str  # PodEverySecond.longest_wait's line


def to_dra_with_pods(kubectl: Kubectl, api: Api, image: str) -> Switched:
    """``to_dra`` with a FUSE pod created every second in STREAM_NS, three before it and
    three after, each waited on until it has ended."""
    kubectl(*APPLY, "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": STREAM_NS}}))
    with PodEverySecond(api, image, STREAM_NS) as stream:
        wait_for(lambda: len(stream.names) >= 3, 30, "three pods before the switch")
        began = time.monotonic()
        lines = to_dra(kubectl)
        took = time.monotonic() - began
        after = len(stream.names) + 3
        wait_for(lambda: len(stream.names) >= after, 30, "three pods after the switch")
    ended = stream.phases()
    return Switched(
        lines, took, len(ended),
        {n: st.get("message", "") for n, st in ended.items() if st.get("phase") != "Succeeded"},
        stream.errors, {n: served_by_dra({"status": ended[n]}) for n in stream.names[-3:]},
        stream.longest_wait())


def test_device_plugin_to_dra_and_back_with_a_pod_reading_throughout(
    *, deployed: dict[str, Any], servers: Servers, kubectl: Kubectl, api: Api,
    overlay: Path, images: dict[str, str], tmp_path: Path
) -> None:
    exec_in(kubectl, SERVERS_NS, "sshd", "echo switch > /srv/data/switch.txt")
    apply_sshfs_example(kubectl, servers, images, tmp_path)
    try:
        wait_mounted(kubectl, api, SSHFS_POD, "/mnt/remote", "fuse.sshfs")
        exec_in(kubectl, EXAMPLES_NS, SSHFS_POD, READER)
        wait_for(lambda: reads(kubectl)[0] > 0 or None, 30, "the reader's first read")

        # -- to DRA: apply the component, then the one command apply cannot do.
        kubectl(*APPLY, "-k", str(driver_overlay(overlay, images["PLUGIN_IMAGE"])))
        rollout(kubectl, DRIVER_DS)
        wait_for(lambda: slices(api), 90, "the driver's slice")
        both = fuse_resources(api)
        switch = to_dra_with_pods(kubectl, api, images["WORKLOAD_IMAGE"])
        gone = fuse_resources(api)
        apply_fuse_pod(kubectl, "on-dra", images, 0)
        on_dra = wait_ready(api, DRA_NS, "on-dra")
        dra_specs = set(claim_specs())
        on_dra_reads = reads(kubectl)

        # -- back: the device plugin again; the driver stays for the pods it prepared.
        kubectl(*APPLY, "-k", str(overlay))
        rollout(kubectl, PLUGIN_DS)
        wait_allocatable(api, DEFAULT_SLOTS)
        apply_fuse_pod(kubectl, "on-plugin", images, 0)
        on_plugin = wait_ready(api, DRA_NS, "on-plugin")
        still = exec_in(kubectl, DRA_NS, "on-dra", "(exec 3<>/dev/fuse) && echo still opens")
        delete_pod(kubectl, api, DRA_NS, "on-dra")
        wait_for(lambda: not (dra_specs & set(claim_specs())) or None, 60,
                 "the DRA pod's claim to be unprepared")
        left = [d for d in kubectl(*OURS_LEFT).split() if d == DRIVER]
        removed = kubectl(*REMOVE_DRIVER)
        wait_for(lambda: not api.pods(PLUGIN_NS, f"app.kubernetes.io/name={DRIVER_DS}")
                 or None, 90, "the driver's pod to be gone")
        back = reads(kubectl)
        wiped = wait_for(lambda: not slices(api) or None, 120,
                         "the kubelet to wipe the gone driver's slice",
                         detail=lambda: json.dumps(slices(api))[:300])
        proof = evidence(
            "dra-switch", f"both deployed: node {both} (the plugin serves while it is there)",
            f"to DRA in {switch.took:.1f}s, the node then {gone}:", *switch.lines,
            f"{switch.made} FUSE pods created one a second through the switch: "
            f"{switch.made - len(switch.rejected)} Succeeded, rejected: {switch.rejected}",
            *switch.errors, switch.longest_wait,
            f"the last three, created after it, served by DRA: {switch.last_by_dra}",
            f"on-dra: DRA claim {served_by_dra(on_dra)}, specs {[p.name for p in dra_specs]}",
            f"on-plugin: DRA claim {served_by_dra(on_plugin)}; on-dra meanwhile: {still}",
            f"claims of {DRIVER} left before removing the driver: {len(left)}",
            *removed.splitlines(), f"slice wiped: {wiped}",
            f"reader: after the switch to DRA {on_dra_reads}, after the way back {back} (ok, FAIL)",
            f"CDI specs of the driver left: {[p.name for p in claim_specs()]}")
        assert both[1] == DEFAULT_SLOTS, proof
        assert gone[1] in (0, None), proof
        assert not switch.errors, proof
        assert not switch.rejected, proof
        assert all(switch.last_by_dra.values()), proof
        assert served_by_dra(on_dra), proof
        assert dra_specs, proof
        assert not served_by_dra(on_plugin), proof
        assert "still opens" in still, proof
        assert left == [], proof
        assert claim_specs() == [], proof
        assert back[1] == 0, proof
        assert back[0] > on_dra_reads[0] > 0, proof
    finally:
        kubectl("delete", "namespace", STREAM_NS, "--ignore-not-found", "--wait=false")
        delete_pod(kubectl, api, DRA_NS, "on-plugin")
        delete_pod(kubectl, api, DRA_NS, "on-dra")
        delete_sshfs_example(kubectl, api)
