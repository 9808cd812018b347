"""Identity from what the tenant cannot change (issue 44): a container is the cgroup the
runtime made for it, seen from the node's cgroup namespace, whatever the tenant makes
below it.

A pod's root (containerd's default capabilities, the real RuntimeDefault rules, which
allow ``unshare`` and ``mount``) can make a user, mount and cgroup namespace of its own,
mount its own cgroup hierarchy there (its root is the container's cgroup) and move its
processes into cgroups it makes below it. The broker named a caller's container by its
whole cgroup path, so each such cgroup counted as a container of a pod of its own: one
container held 2 mounts per sub-cgroup under ``--max-mounts 2`` (12 live mounts in the
review, and a neighbour then refused by the node's cap). Now the container is the cgroup
just below the pod's (``policy.container_of``), and the caps hold.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import BrokerProcess, attack

PER_CONTAINER = 2
PER_POD = 4
SPLITS = 4  # cgroups the tenant makes below its container's, one asking process each
EACH = 3  # mounts each of them asks for


def named(proc_cgroup: str) -> str:
    """The cgroup the broker names a caller by: cgroup v1's devices line, else v2's."""
    lines = proc_cgroup.splitlines()
    line = next((x for x in lines if ":devices:" in x), None) or \
        next(x for x in lines if x.startswith("0::"))
    return line.split(":", 2)[2]


def test_cgroups_a_tenant_makes_below_its_container_are_still_its_container(
        broker_dir: Path, broker_allocation: api.ContainerAllocateResponse,
        runc: oci.Runc, tmp_path: Path) -> None:
    broker = BrokerProcess(broker_dir, tmp_path / "broker", broker_rig.shim(),
                           "--max-mounts", str(PER_CONTAINER),
                           "--max-mounts-pod", str(PER_POD)).start()
    try:
        pod = f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"
        request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                       seccomp=profiles.runtime_default(), tmpfs=("/mnt",),
                                       binds=[broker_rig.attacker_bind()])
        tenant = runc.create(oci.build_spec(request), "splitter", pod=pod).start()
        found = attack(tenant, "split-cgroups", str(SPLITS), str(EACH), "/mnt/split",
                       timeout=300)
        assert found["split"].get("moved"), found["split"]
        own = f"/{pod}/{tenant.id}"
        # The tenant did move its askers into cgroups of its making, as the node sees them.
        made = {named(asker["cgroup"]) for asker in found["askers"]}
        assert len(made) == SPLITS, made
        assert all(c.startswith(f"{own}/split") for c in made), made
        served = sum(asker["counts"].get("ok", 0) for asker in found["askers"])
        assert served == PER_CONTAINER, found["askers"]
        refusals = [m for asker in found["askers"] for m in asker["messages"]]
        assert any(f"its limit (--max-mounts {PER_CONTAINER})" in m for m in refusals), \
            refusals
        # Every mount the broker made is its container's, as the records say.
        assert {e["cgroup"] for e in broker.events("broker.mount")} == {own}
    finally:
        broker.stop()
