"""Fair shares (issue 26): no pod can take a node-wide cap from the rest.

The containers of one pod (runc containers whose cgroups are nested in one pod cgroup,
as the kubelet nests them) used to add up to the node's caps: three containers holding
their --max-mounts reached --max-mounts-node and every other pod was refused; one pod of
64 containers holding four silent connections each took all 256 and every other pod's
request was answered "busy". Now a pod gets --max-mounts-pod of the node's mounts and
``shares.PER_POD`` of its open requests (and ``shares.PER_POD_HELPERS`` of its helpers),
and a container outside any pod's cgroup is a pod of its own.

The tenants have containerd's default capabilities and the real RuntimeDefault rules.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import shares
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import BrokerProcess, Held, attack

MAX_MOUNTS, POD_SHARE, NODE_CAP = 4, 6, 8


@pytest.fixture
def shared(broker_dir: Path, tmp_path: Path) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(broker_dir, tmp_path / "broker", broker_rig.shim(),
                           "--max-mounts", str(MAX_MOUNTS), "--max-mounts-pod",
                           str(POD_SHARE), "--max-mounts-node", str(NODE_CAP))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def tenant_spec(allocation: api.ContainerAllocateResponse) -> oci.Spec:
    return oci.build_spec(oci.ContainerRequest(
        args=workloads.HOLD, allocation=allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind()]))


def test_one_pods_containers_cannot_take_the_nodes_mounts(
        shared: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    pod = f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"
    spec = tenant_spec(broker_allocation)
    with oci.Runc() as runc:
        members = [runc.create(spec, f"member{i}", pod=pod).start() for i in range(3)]
        outsider = runc.create(spec, "outsider").start()
        taken = []
        for member in members:
            result = attack(member, "ask", "--fuse", "--repeat", str(MAX_MOUNTS + 1),
                            "--mkdir", "op=mount", "path=/mnt/q/{i}")
            taken.append(result["counts"].get("ok", 0))
        assert taken == [MAX_MOUNTS, POD_SHARE - MAX_MOUNTS, 0]
        refused = attack(members[2], "ask", "--fuse", "op=mount", "path=/mnt/q/0")
        assert f"its share (--max-mounts-pod {POD_SHARE})" in refused["message"]
        # The rest of the node's mounts are left for other pods.
        other = attack(outsider, "ask", "--fuse", "--repeat", str(NODE_CAP), "--mkdir",
                       "op=mount", "path=/mnt/o/{i}")
        assert other["counts"] == {"ok": NODE_CAP - POD_SHARE,
                                   "error": POD_SHARE}, other


def test_one_pods_silent_connections_leave_the_rest_of_the_node_served(
        shared: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    pod = f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"
    spec = tenant_spec(broker_allocation)
    members_needed = shares.PER_POD // shares.PER_CONTAINER + 1
    with oci.Runc() as runc:
        members = [runc.create(spec, f"member{i}", pod=pod).start()
                   for i in range(members_needed)]
        outsider = runc.create(spec, "outsider").start()
        outsider.sh("mkdir -p /mnt/n").check()
        holds = [Held(m, "silent", str(shares.PER_CONTAINER), "--settle") for m in members]
        assert sum(h.answer["held"] for h in holds) == shares.PER_POD
        refusals = [message for h in holds for message in h.answer["refused"]]
        assert any("this pod has 16 requests open, its share" in m for m in refusals)
        answer = attack(outsider, "ask", "--fuse", "op=mount", "path=/mnt/n")
        assert answer["status"] == "ok", answer
        for hold in holds:
            hold.release()
