"""Broker mode under the real kubelet (issue 14): the plugin runs with --broker-dir, the
broker runs on the node, and a static pod whose only FUSE-related line is
``github.com/fuse: 1`` mounts sshfs, writes and reads through it and unmounts it, with
no added capability and containerd's RuntimeDefault seccomp profile.

The node, its setup and the sshd come from test_real_kubelet.py; this module's
``kube_node`` replaces that module's, so the imported ``sshd`` fixture runs on it. The
pod is hostNetwork only because this node has no CNI. The client key reaches the pod
in an environment variable, so that the pod needs no hostPath either.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fuse_plugin.broker import protocol
from tests.containers import broker as broker_rig
from tests.kubelet import node as nodemod
from tests.kubelet.test_real_kubelet import (  # noqa: F401 (sshd is a fixture)
    HERE,
    SETUP_TIMEOUT,
    SLOTS,
    _skip_reason,
    container,
    evidence,
    pod_spec,
    pods,
    sshd,
    wait_registered,
)
from tests.unit.test_manifests_broker import baseline_violations

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BROKER_DIR = nodemod.STATE / "broker"
CAP_SYS_ADMIN_BIT = 21

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


@pytest.fixture(scope="module")
def kube_node() -> Iterator[Any]:
    """The e2e node in broker mode: the broker first, then containerd, the plugin with
    --broker-dir, and the kubelet."""
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
        node.up(slots=SLOTS, plugin_args=("--broker-dir", str(BROKER_DIR)))
        node.broker_log_since = nodemod.log_size(nodemod.LOGDIR / "broker.log")
        node.spawn("broker", [str(node.plugin_bin), "broker", "--dir", str(BROKER_DIR),
                              "--shim", str(broker_rig.shim()), "--staging-dir",
                              str(nodemod.STATE / "broker-staging"), "--log-format", "json"])
        nodemod.wait_for((BROKER_DIR / protocol.SOCKET_NAME).is_socket, 30,
                         "the broker's socket",
                         detail=lambda: nodemod.tail(nodemod.LOGDIR / "broker.log"))
        wait_registered(node, 0, "node start (broker mode)")
        yield node
    finally:
        node.down()
        node.unlock()


def broker_events(node: Any, name: str) -> list[dict[str, Any]]:
    found = []
    for line in nodemod.read_log(nodemod.LOGDIR / "broker.log",
                                 node.broker_log_since).splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event["event"] == name:
                found.append(event)
    return found


def test_one_line_pod_mounts_sshfs_through_the_broker(
        kube_node: Any, sshd: dict[str, Any]) -> None:  # noqa: F811 (the fixture)
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
    [mounted] = broker_events(kube_node, "broker.mount")
    [unmounted] = broker_events(kube_node, "broker.unmount")
    assert mounted["path"] == unmounted["path"] == "/mnt/remote"
    assert unmounted["mount_id"] == mounted["mount_id"]
    evidence("broker", [line for line in log.splitlines()
                        if line.startswith(("MOUNTED", "CapEff", "Seccomp", "READ",
                                            "UNMOUNTED"))]
             + [json.dumps(mounted), json.dumps(unmounted)])
    print(f"broker-mode pod {name}: {mounted['duration_ms']} ms in the broker",
          file=sys.stderr)
