"""Helpers charged to their callers (issue 34): a tenant's helpers spend the tenant's
pod's memory, CPU and processes, not the broker's.

Each request's helper ran in the broker's cgroups, so every tenant's helpers were
charged to the broker's pod: its memory limit (320Mi) and its CPU request (100m) were
shared by whatever any tenant made the broker do. Now the helper moves itself into its
caller's cgroups (memory, cpu, cpuacct, pids) before it reads its request
(``fuse_plugin/broker/cgroups.py``).

The tenants are pods of runc containers nested in a pod cgroup as the kubelet nests
them, with containerd's default capabilities and the real RuntimeDefault rules. What
they show:

- the helper's process the pod sees in its PID namespace (``tests/lib/prey.py watch``)
  is in the pod container's memory, cpu, cpuacct and pids cgroups, as ``hostUsers:
  true`` and ``false``;
- a pod at its limit pays for its own helpers: at its process limit (the kubelet's
  podPidsLimit, pids.max on the pod's cgroup) its mounts fail, the helper unable to fork,
  while a neighbour pod mounts; with room again, it mounts;
- a pod at its memory limit, with the kernel's OOM killer off in it so that what
  allocates there waits instead of being killed, holds its own helpers waiting (the
  broker kills them at its deadline), not the broker: a neighbour pod mounts meanwhile,
  and the broker's own memory cgroup never reaches its limit.

Each failed on main before this change (the helper's agent forked in the broker's pids
cgroup; the helpers allocated in the broker's memory cgroup and did not wait).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess, Burst, attack

CGROUPS = Path("/sys/fs/cgroup")
CHARGED = ("memory", "cpu", "cpuacct", "pids")
PREY = f"{broker_rig.ATTACKER_DIR}/prey.py"
ROUNDS = 100
# The greedy pod's callers have this many groups, which its helpers take (the kernel's
# copy, and the request's frame): far more memory than the headroom it is left, which
# its burst's own connections fit in.
GROUPS = 32768
HEADROOM = 256 << 10


def pod_name() -> str:
    return f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"


def tenant(runc: oci.Runc, allocation: api.ContainerAllocateResponse, name: str,
           pod: str, *, host_users: bool = True, groups: int = 0) -> oci.RuncContainer:
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=allocation,
                                   seccomp=profiles.runtime_default(), tmpfs=("/mnt",),
                                   binds=[broker_rig.attacker_bind()], host_users=host_users,
                                   groups=range(1000, 1000 + groups))
    return runc.create(oci.build_spec(request), name, pod=pod).start()


def cgroup_lines(pid: int) -> set[str]:
    """The accounting lines of a process's /proc/PID/cgroup, as the node reads them."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {line for line in lines if set(line.split(":")[1].split(",")) & set(CHARGED)}


@pytest.fixture
def confined(broker: BrokerProcess) -> Iterator[tuple[BrokerProcess, str]]:
    """The broker in cgroups of its own (memory, cpu, cpuacct, pids), as its DaemonSet's
    pod is, its memory limited to twice what it uses at rest plus 8 MiB; the cgroup's
    path (the same in each hierarchy)."""
    name = f"fuse-e2e-broker{uuid.uuid4().hex[:12]}"

    made = []
    try:
        for controller in CHARGED:
            cgroup = CGROUPS / controller / name
            cgroup.mkdir()
            made.append(cgroup)
            (cgroup / "cgroup.procs").write_text(str(broker.pid))
        memory = CGROUPS / "memory" / name
        usage = int((memory / "memory.usage_in_bytes").read_text())
        (memory / "memory.limit_in_bytes").write_text(str(max(usage, 1 << 20) * 2 + (8 << 20)))
        yield broker, f"/{name}"
    finally:
        broker.stop()
        for cgroup in made:
            with contextlib.suppress(OSError):
                cgroup.rmdir()



def mount_once(container: oci.RuncContainer, path: str) -> dict[str, Any]:
    return attack(container, "ask", "--fuse", "op=mount", f"path={path}")


@pytest.mark.parametrize("host_users", [True, False], ids=["hostUsers-true", "hostUsers-false"])
def test_the_helper_runs_in_the_callers_cgroups(
        confined: tuple[BrokerProcess, str], broker_allocation: api.ContainerAllocateResponse,
        runc: oci.Runc, host_users: bool) -> None:
    """Every helper process the pod catches in its PID namespace while it mounts is in
    the container's own memory, cpu, cpuacct and pids cgroups, none in the broker's. (A
    process that is exiting shows "/" in a cgroup v1 hierarchy: the broker's are not
    "/" here.)"""
    _, broker_cgroup = confined
    pod = pod_name()
    container = tenant(runc, broker_allocation, "charged", pod, host_users=host_users)
    result = container.exec("python3", PREY, "watch", str(ROUNDS), "/mnt/prey", timeout=600)
    assert result.returncode == 0, result.output
    found: dict[str, Any] = json.loads(result.stdout)
    assert found["caught"] > 0, found
    assert found["answers"]["counts"] == {"ok": ROUNDS}, found["answers"]
    seen = {line for line in found["cgroups"]
            if set(line.split(":")[1].split(",")) & set(CHARGED)
            and not line.endswith(":/")}
    assert seen == cgroup_lines(container.pid), (seen, cgroup_lines(container.pid))
    assert all(f":/{pod}/" in line for line in seen), seen
    assert not [line for line in found["cgroups"] if line.endswith(broker_cgroup)], found


@contextlib.contextmanager
def limited(path: Path, value: str, unlimited: str) -> Iterator[None]:
    """A cgroup limit set for the block (the kubelet's podPidsLimit, a pod's memory
    limit), then lifted."""
    path.write_text(value)
    try:
        yield
    finally:
        path.write_text(unlimited)


def test_a_pod_at_its_process_limit_pays_for_its_own_helpers(
        confined: tuple[BrokerProcess, str], broker_allocation: api.ContainerAllocateResponse,
        runc: oci.Runc) -> None:
    """pids.max of the greedy pod at the processes it has: its requests still reach the
    broker (a process moved into a cgroup is not counted against the limit), but the
    helper, now in the pod, cannot fork its agent, and the mount fails with that. The
    neighbour pod mounts meanwhile; with room again, the greedy pod mounts too."""
    broker, _ = confined
    greedy_pod, neighbour_pod = pod_name(), pod_name()
    greedy = tenant(runc, broker_allocation, "greedy", greedy_pod)
    neighbour = tenant(runc, broker_allocation, "neighbour", neighbour_pod)
    greedy.sh("mkdir -p /mnt/g").check()
    neighbour.sh("mkdir -p /mnt/n").check()
    pids_max = CGROUPS / "pids" / greedy_pod / "pids.max"
    current = (CGROUPS / "pids" / greedy_pod / "pids.current").read_text().strip()
    with limited(pids_max, current, "max"):
        refused = mount_once(greedy, "/mnt/g")
        assert refused["status"] == "error", refused
        assert "fork the agent: Resource temporarily unavailable" in refused["message"], refused
        served = mount_once(neighbour, "/mnt/n")
        assert served["status"] == "ok", served
    again = mount_once(greedy, "/mnt/g")
    assert again["status"] == "ok", again
    [failed] = [e for e in broker.events("broker.failed") if greedy.id in e.get("cgroup", "")]
    assert "fork the agent" in failed["reason"], failed


def memory_file(cgroup: str, name: str) -> Path:
    return CGROUPS / "memory" / cgroup.strip("/") / name


def at_its_limit(cgroup: str, headroom: int) -> None:
    """Shrink the cgroup's memory to what it cannot give back (the kernel reclaims its
    page cache until a lower limit is refused: no swap here), then limit it to that plus
    ``headroom``."""
    limit = memory_file(cgroup, "memory.limit_in_bytes")
    while True:
        usage = int(memory_file(cgroup, "memory.usage_in_bytes").read_text())
        try:
            limit.write_text(str(max(usage - (1 << 20), 0)))
        except OSError:
            break
    usage = int(memory_file(cgroup, "memory.usage_in_bytes").read_text())
    limit.write_text(str(usage + headroom))


def under_oom(cgroup: str) -> bool:
    return "under_oom 1" in memory_file(cgroup, "memory.oom_control").read_text()


def test_a_pod_at_its_memory_limit_holds_its_own_helpers_not_the_broker(
        confined: tuple[BrokerProcess, str],
        broker_allocation: api.ContainerAllocateResponse, runc: oci.Runc) -> None:
    """The greedy pod's burst of mounts is ready (its process started, its connections
    to open on ``go``); then its pod cgroup is held at its memory limit with the OOM
    killer off in it, and it goes. Its helpers, charged to the pod, wait in the pod's
    OOM and are killed at the broker's deadline (``broker.stalled``); the pod is seen
    under OOM. A neighbour pod mounts while they wait, and the broker's memory cgroup
    never hits its limit. Once the pod has room again, the burst ends."""
    broker, broker_cgroup = confined
    greedy_pod, neighbour_pod = pod_name(), pod_name()
    greedy = tenant(runc, broker_allocation, "greedy", greedy_pod, groups=GROUPS)
    neighbour = tenant(runc, broker_allocation, "neighbour", neighbour_pod)
    greedy.sh("mkdir -p /mnt/burst").check()
    neighbour.sh("mkdir -p /mnt/n").check()
    burst = Burst(greedy, 2, "/mnt/burst")
    assert burst.line()["ready"], "the burst says it is ready"
    failures = int(memory_file(broker_cgroup, "memory.failcnt").read_text())
    pod = f"/{greedy_pod}"
    memory_file(pod, "memory.oom_control").write_text("1")
    try:
        with limited(memory_file(pod, "memory.limit_in_bytes"), "-1", "-1"):
            at_its_limit(pod, HEADROOM)
            burst.go()
            waiting.wait_for(lambda: under_oom(pod), 30, "the greedy pod to reach its limit",
                             detail=lambda: memory_file(pod, "memory.oom_control").read_text()
                             + memory_file(pod, "memory.failcnt").read_text()
                             + str(broker.events()[-5:]))
            served = mount_once(neighbour, "/mnt/n")
            assert served["status"] == "ok", served
            waiting.wait_for(lambda: [e for e in broker.events("broker.stalled")
                                      if greedy.id in e.get("cgroup", "")], 30,
                             "the broker to kill a helper waiting in the greedy pod's OOM")
    finally:
        memory_file(pod, "memory.oom_control").write_text("0")
    outcome = burst.line()
    burst.release()
    assert int(memory_file(broker_cgroup, "memory.failcnt").read_text()) == failures
    assert broker.proc is not None
    assert broker.proc.poll() is None
    print(f"\n[memory] burst {outcome}")
