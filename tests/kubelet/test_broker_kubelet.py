"""Broker mode under the real kubelet (issues 14 and 21): the plugin runs with
--broker-dir, the broker runs on the node, and static pods whose only FUSE-related line is
``github.com/fuse: 1`` mount sshfs, write and read through it and unmount it, with no
added capability and containerd's RuntimeDefault seccomp profile: one as root, one as
uid 1000 with the complete Pod Security `restricted` security context.

The node, its setup and the sshd come from test_real_kubelet.py; this module's
``kube_node`` replaces that module's, so the imported ``sshd`` fixture runs on it. The
pods are hostNetwork only because this node has no CNI. The client key reaches a pod
in an environment variable, so that it needs no hostPath either.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fuse_plugin.broker import protocol
from tests.kubelet import node as nodemod
from tests.kubelet.static_pods import (
    HERE,
    RESOURCE,
    SETUP_TIMEOUT,
    SLOTS,
    _skip_reason,
    container,
    evidence,
    pod_spec,
    pods,
    wait_registered,
)
from tests.lib import broker as broker_rig
from tests.lib.manifests import (
    COMPLETE_RESTRICTED,
    baseline_violations,
    restricted_violations,
)

DAEMONSET = Path(__file__).resolve().parents[2] / "manifests" / "broker" / "broker-daemonset.yaml"
BROKER_DIR = nodemod.STATE / "broker"
BROKER_STATE = nodemod.STATE / "broker-state"
CHECKPOINT = nodemod.DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint"
CAP_SYS_ADMIN_BIT = 21
NONROOT_UID = COMPLETE_RESTRICTED["runAsUser"]

SCRIPT = r"""set -e
mkdir -p /tmp/key /mnt/remote
printf '%s\n' "$KEY" > /tmp/key/id && chmod 600 /tmp/key/id
sshfs -p "$PORT" -o IdentityFile=/tmp/key/id -o StrictHostKeyChecking=no \
    -o UserKnownHostsFile=/dev/null -o BatchMode=yes root@127.0.0.1:"$EXPORT" /mnt/remote
echo "MOUNTED $(grep ' /mnt/remote ' /proc/self/mountinfo)"
grep -E '^(CapEff|Seccomp):' /proc/self/status
echo "$PAYLOAD" > "/mnt/remote/$POD_NAME.txt"
echo "READ $(cat /mnt/remote/from-server.txt)"
fusermount3 -u /mnt/remote
grep -q ' /mnt/remote ' /proc/self/mountinfo || echo UNMOUNTED
"""


def with_daemonset_capabilities() -> list[str]:
    """setpriv's prefix that gives the broker exactly the capabilities its DaemonSet adds
    (manifests/broker/broker-daemonset.yaml), as uid 0: root's capabilities after exec
    are the bounding set once the inheritable ones are cleared."""
    for doc in yaml.safe_load_all(DAEMONSET.read_text()):
        if doc and doc["kind"] == "DaemonSet":
            context = doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]
            caps = ",".join(f"+{c.lower()}" for c in context["capabilities"]["add"])
            return ["setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}", "--"]
    raise LookupError(f"no DaemonSet in {DAEMONSET}")


@pytest.fixture(scope="module")
def kube_node() -> Iterator[Any]:
    """The e2e node in broker mode: containerd, the plugin with --broker-dir, the kubelet,
    then the broker (as the DaemonSet's flags have it). Pods are added only once the
    kubelet holds the slots as healthy: the plugin reports them Unhealthy until the
    broker has installed its shim, and a standalone kubelet fails a pod it cannot admit
    for good."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    nodemod.LOGDIR.mkdir(parents=True, exist_ok=True)
    with open(nodemod.LOGDIR / "setup.log", "w") as out:
        setup = subprocess.run([str(HERE / "setup.sh"), "all"], stdout=out,
                               stderr=subprocess.STDOUT, timeout=SETUP_TIMEOUT, check=False)
    assert setup.returncode == 0, nodemod.tail(nodemod.LOGDIR / "setup.log", 60)
    node: Any = nodemod.Node()
    try:
        # No shim from an earlier run: the plugin starts with its slots unhealthy.
        shutil.rmtree(BROKER_DIR, ignore_errors=True)
        node.up(slots=SLOTS, plugin_args=("--broker-dir", str(BROKER_DIR)))
        node.broker_log_since = nodemod.log_size(nodemod.LOGDIR / "broker.log")
        node.spawn("broker", [*with_daemonset_capabilities(), str(node.plugin_bin), "broker",
                              "--dir", str(BROKER_DIR), "--state-dir", str(BROKER_STATE),
                              "--shim", str(broker_rig.shim()), "--log-format", "json"])
        nodemod.wait_for((BROKER_DIR / protocol.SOCKET_NAME).is_socket, 30,
                         "the broker's socket",
                         detail=lambda: nodemod.tail(nodemod.LOGDIR / "broker.log"))
        wait_registered(node, 0, "node start (broker mode)")
        healthy = nodemod.wait_for(
            lambda: nodemod.grep_log(nodemod.LOGDIR / "plugin.log", "health=Healthy"), 30,
            "the plugin to report its slots healthy once the broker's shim is there",
            detail=lambda: nodemod.tail(nodemod.LOGDIR / "plugin.log", 10))
        nodemod.wait_for(lambda: healthy_slots() == SLOTS, 30,
                         f"the kubelet to hold {SLOTS} healthy slots",
                         detail=lambda: f"checkpoint: {healthy_slots()}\n"
                         + nodemod.tail(nodemod.LOGDIR / "plugin.log", 10))
        evidence("broker", [*nodemod.grep_log(nodemod.LOGDIR / "plugin.log", r" start .*health="),
                            healthy[0], f"kubelet checkpoint: {healthy_slots()} healthy slots"])
        yield node
    finally:
        node.down()
        node.unlock()


def healthy_slots() -> int:
    """The slots the kubelet holds as healthy: its device-manager checkpoint lists the
    healthy devices of each resource, rewritten at every update the plugin sends."""
    try:
        data = json.loads(CHECKPOINT.read_text())["Data"]
    except (OSError, ValueError, KeyError):
        return -1
    return len((data.get("RegisteredDevices") or {}).get(RESOURCE, []))


def broker_events(node: Any, name: str, path: str) -> list[dict[str, Any]]:
    """The broker's JSON log events of one kind for one mountpoint, since node start."""
    found = []
    for line in nodemod.read_log(nodemod.LOGDIR / "broker.log",
                                 node.broker_log_since).splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event["event"] == name and event.get("path") == path:
                found.append(event)
    return found


def test_one_line_pod_mounts_sshfs_through_the_broker(
        kube_node: Any, sshd: dict[str, Any]) -> None:
    name = f"sshfs-broker-{int(time.time())}"
    payload = f"written by {name} through the broker"
    (sshd["export"] / "from-server.txt").write_text("served by sshd\n")
    spec = pod_spec(container(
        kube_node, SCRIPT, fuse=1,
        env=[{"name": "PORT", "value": str(sshd["port"])},
             {"name": "EXPORT", "value": str(sshd["export"])},
             {"name": "KEY", "value": (sshd["dir"] / "keys" / "client").read_text()},
             {"name": "PAYLOAD", "value": payload},
             {"name": "POD_NAME", "value": name}]))
    # Kubelet 1.20 runs pods Unconfined unless told. RuntimeDefault is what broker-mode
    # pods set (on AppArmor nodes it is what makes mount(2) fail with EPERM, the errno on
    # which libfuse asks fusermount3). Nothing else in the pod is about FUSE.
    spec["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    assert baseline_violations({"kind": "Pod", "spec": spec}) == [
        "host namespace hostNetwork"]  # this node has no CNI
    assert "securityContext" not in spec["containers"][0]

    with pods(kube_node, **{name: spec}) as runs:
        run = runs[name]
        run.expect("Succeeded")
        log = run.log()
    fields = dict(line.split(":\t", 1) for line in log.splitlines() if ":\t" in line)
    assert "MOUNTED " in log, run.report()
    assert "fuse.sshfs" in log, run.report()
    assert not int(fields["CapEff"], 16) >> CAP_SYS_ADMIN_BIT & 1
    assert fields["Seccomp"].strip() == "2"
    assert "READ served by sshd" in log
    assert "UNMOUNTED" in log
    assert (sshd["export"] / f"{name}.txt").read_text().strip() == payload
    [mounted] = broker_events(kube_node, "broker.mount", "/mnt/remote")
    [unmounted] = broker_events(kube_node, "broker.unmount", "/mnt/remote")
    assert mounted["path"] == unmounted["path"] == "/mnt/remote"
    assert unmounted["mount_id"] == mounted["mount_id"]
    evidence("broker", [line for line in log.splitlines()
                        if line.startswith(("MOUNTED", "CapEff", "Seccomp", "READ",
                                            "UNMOUNTED"))]
             + [json.dumps(mounted), json.dumps(unmounted)])
    print(f"broker-mode pod {name}: {mounted['duration_ms']} ms in the broker",
          file=sys.stderr)


# ---------------------------------------------------------------- uid 1000, restricted

# The pod's whole filesystem but /work is read-only: the key and the mountpoint live in
# that emptyDir, and ssh reads no config (-F /dev/null) and writes no known_hosts.
RESTRICTED_SCRIPT = r"""set -e
id
printf '%s\n' "$KEY" > /work/id && chmod 600 /work/id
mkdir /work/remote
sshfs -p "$PORT" -F /dev/null -o IdentityFile=/work/id -o StrictHostKeyChecking=no \
    -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o idmap=user \
    root@127.0.0.1:"$EXPORT" /work/remote
echo "MOUNTED $(grep ' /work/remote ' /proc/self/mountinfo)"
grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status
echo "$PAYLOAD" > "/work/remote/$POD_NAME.txt"
echo "READ $(cat /work/remote/from-server.txt)"
stat -c 'OWNER %u:%g %n' /work/remote/from-server.txt "/work/remote/$POD_NAME.txt"
touch /rootfs-write 2>/dev/null || echo "ROOTFS read-only"
fusermount3 -u /work/remote
grep -q ' /work/remote ' /proc/self/mountinfo || echo UNMOUNTED
"""


@pytest.fixture(scope="module")
def nonroot_image(kube_node: Any) -> str:
    """The workload image (images.sh) with a passwd entry for uid 1000: ssh refuses to
    start for a uid without one. Made by mkimage.py from the same host files and imported
    into the node's containerd; the tag is the layer's digest."""
    out = nodemod.CACHE / "images" / "workload-nonroot.tar"
    uid = NONROOT_UID
    made = subprocess.run(
        [sys.executable, str(HERE / "mkimage.py"), "--name", "fdp-e2e/workload-nonroot",
         "--out", str(out), "--entrypoint", "/bin/sh", "--busybox", "/bin/busybox",
         "--binary", "/usr/bin/sshfs", "--binary", "/usr/bin/ssh",
         "--binary", "/usr/bin/fusermount3",
         "--text", f"/etc/passwd:root:x:0:0:root:/root:/bin/sh\\nuser:x:{uid}:{uid}:user:"
                   "/nonexistent:/bin/sh\\n",
         "--text", f"/etc/group:root:x:0:\\nuser:x:{uid}:\\n"],
        capture_output=True, text=True, timeout=300, check=False)
    assert made.returncode == 0, made.stderr
    ref = made.stdout.strip()
    if ref not in kube_node.ctr("images", "ls", "-q").split():
        kube_node.ctr("images", "import", str(out), timeout=600)
    return ref


def test_restricted_pod_mounts_sshfs_as_uid_1000_through_the_broker(
        kube_node: Any, sshd: dict[str, Any],
        nonroot_image: str) -> None:
    """A static pod with the complete Pod Security `restricted` security context (uid and
    gid 1000, no privilege escalation, every capability dropped, RuntimeDefault seccomp,
    read-only root filesystem) mounts sshfs through the broker as uid 1000 (user_id=1000),
    writes, reads, sees the files as its own (idmap=user) and unmounts."""
    name = f"sshfs-restricted-{int(time.time())}"
    payload = f"written by {name} as uid {NONROOT_UID} through the broker"
    (sshd["export"] / "from-server.txt").write_text("served by sshd\n")
    spec = pod_spec(
        container(
            kube_node, RESTRICTED_SCRIPT, fuse=1, image=nonroot_image,
            securityContext=COMPLETE_RESTRICTED,
            volumeMounts=[{"name": "work", "mountPath": "/work"}],
            env=[{"name": "PORT", "value": str(sshd["port"])},
                 {"name": "EXPORT", "value": str(sshd["export"])},
                 {"name": "KEY", "value": (sshd["dir"] / "keys" / "client").read_text()},
                 {"name": "PAYLOAD", "value": payload},
                 {"name": "POD_NAME", "value": name}]),
        volumes=[{"name": "work", "emptyDir": {}}])
    assert restricted_violations({"kind": "Pod", "spec": spec}) == [
        "host namespace hostNetwork"]  # this node has no CNI

    with pods(kube_node, **{name: spec}) as runs:
        run = runs[name]
        run.expect("Succeeded")
        log = run.log()
    fields = dict(line.split(":\t", 1) for line in log.splitlines() if ":\t" in line)
    mounted_line = next((ln for ln in log.splitlines() if ln.startswith("MOUNTED ")), "")
    proof = log + "\n" + run.report()
    assert f"uid={NONROOT_UID}" in log, proof
    assert "fuse.sshfs" in mounted_line, proof
    assert f"user_id={NONROOT_UID}" in mounted_line, proof
    assert int(fields["CapEff"], 16) == 0, proof
    assert fields["NoNewPrivs"].strip() == "1", proof
    assert fields["Seccomp"].strip() == "2", proof
    assert "READ served by sshd" in log, proof
    owners = [ln.split()[1] for ln in log.splitlines() if ln.startswith("OWNER ")]
    assert owners == [f"{NONROOT_UID}:{NONROOT_UID}"] * 2, proof
    assert "ROOTFS read-only" in log, proof
    assert "UNMOUNTED" in log, proof
    assert (sshd["export"] / f"{name}.txt").read_text().strip() == payload
    [mounted] = broker_events(kube_node, "broker.mount", "/work/remote")
    [unmounted] = broker_events(kube_node, "broker.unmount", "/work/remote")
    assert mounted["uid"] == unmounted["uid"] == NONROOT_UID, (mounted, unmounted)
    assert unmounted["mount_id"] == mounted["mount_id"]
    evidence("broker-restricted",
             [line for line in log.splitlines()
              if re.match(r"(uid=|MOUNTED|CapEff|NoNewPrivs|Seccomp|READ|OWNER|ROOTFS|"
                          r"UNMOUNTED)", line)]
             + [json.dumps(mounted), json.dumps(unmounted)])
