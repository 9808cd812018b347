"""Switching a node from the device plugin to the DRA driver and back, as docs/dra.md's
"Switching" says, with a FUSE pod reading its sshfs mount every 200 ms throughout: its
reads never fail, new pods are served by whichever path is current, the node never
serves `github.com/fuse` from both at once, and after the way back nothing of the driver
is left (no stuck pod, no CDI spec). A cluster of its own: it starts from the device
plugin, where test_cluster_dra starts from the driver."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.cluster.cluster import Api, Kubectl
from tests.cluster.kube import (
    APPLY,
    DEFAULT_SLOTS,
    EXAMPLES_NS,
    PLUGIN_DS,
    PLUGIN_NS,
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

# docs/dra.md, "Switching": the commands a user types, word for word.
TO_DRA_DELETE = ("-n", "fuse-device-plugin", "delete", "daemonset", "fuse-device-plugin")
OURS_LEFT = ("get", "resourceclaims", "-A", "-o",
             "jsonpath={range .items[*]}{.status.allocation.devices.results[*].driver}"
             "{\"\\n\"}{end}")
REMOVE_DRIVER = ("delete", "-A", "-l", "app.kubernetes.io/name=fuse-dra-driver",
                 "daemonset,serviceaccount,networkpolicy,deviceclass,clusterrole,"
                 "clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding")
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
        kubectl(*TO_DRA_DELETE)
        wait_for(lambda: fuse_resources(api)[1] in (0, None) or None, 90,
                 "the node's allocatable github.com/fuse to drop to 0")
        apply_fuse_pod(kubectl, "on-dra", images, 0)
        on_dra = wait_ready(api, DRA_NS, "on-dra")
        dra_specs = set(claim_specs())
        to_dra = reads(kubectl)

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
            f"on-dra: DRA claim {served_by_dra(on_dra)}, specs {[p.name for p in dra_specs]}",
            f"on-plugin: DRA claim {served_by_dra(on_plugin)}; on-dra meanwhile: {still}",
            f"claims of {DRIVER} left before removing the driver: {len(left)}",
            *removed.splitlines(), f"slice wiped: {wiped}",
            f"reader: after the switch to DRA {to_dra}, after the way back {back} (ok, FAIL)",
            f"CDI specs of the driver left: {[p.name for p in claim_specs()]}")
        assert both[1] == DEFAULT_SLOTS, proof
        assert served_by_dra(on_dra), proof
        assert dra_specs, proof
        assert not served_by_dra(on_plugin), proof
        assert "still opens" in still, proof
        assert left == [], proof
        assert claim_specs() == [], proof
        assert back[1] == 0, proof
        assert back[0] > to_dra[0] > 0, proof
    finally:
        delete_pod(kubectl, api, DRA_NS, "on-plugin")
        delete_pod(kubectl, api, DRA_NS, "on-dra")
        delete_sshfs_example(kubectl, api)
