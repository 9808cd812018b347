"""The mount belongs to the caller's PID namespace (issue 26).

The kernel names every process that touches a FUSE mount to its daemon by its pid in
the superblock's PID namespace, which is that of the process that created it. The broker's
helper made it from the node's, so a tenant's daemon saw node pids of every process
touching its mount (a process that was PID 18 in the container arrived as 28463). Now a
process in the caller's PID namespace creates it: the daemon sees container pids, and 0
for any process outside the container.

That process is the one the pod sees of the broker (issue 34), and the pod's root
preys on it (``tests/lib/prey.py``) while it mounts, as ``hostUsers: true`` and
``false``: it looks inside it, stops it and kills it. The step holds the node's
credentials, is not dumpable, and holds the context and the pod's own /dev/fuse only;
a signal the kernel lets through ends that one request, at once.

The tenant has containerd's default capabilities and the real RuntimeDefault rules; its
daemon is the toolkit's recording stub.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess, Held

RECORD = "/tmp/requests.jsonl"
FUSE_LOOKUP = 1


def lookups(container: oci.RuncContainer) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for line in Path(f"/proc/{container.pid}/root{RECORD}").read_text().splitlines():
        record = json.loads(line)
        if record["opcode"] == FUSE_LOOKUP:
            found.setdefault(record["name"], []).append(record)
    return found


def test_the_daemon_sees_container_pids_and_nothing_of_the_nodes(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                   seccomp=profiles.runtime_default(),
                                   binds=[broker_rig.attacker_bind()])
    with oci.Runc() as runc:
        tenant = runc.create(oci.build_spec(request), "pids").start()
        tenant.sh("mkdir -p /mnt/s").check()
        stub = Held(tenant, "serve", "/mnt/s", RECORD)
        assert stub.answer["status"] == "ok"
        # The shell's pid in the container is the one that execs stat.
        inside = tenant.sh("echo $$; exec stat /mnt/s/from-inside >/dev/null")
        container_pid = int(inside.stdout.split()[0])
        os.stat(f"/proc/{tenant.pid}/root/mnt/s/from-node")  # this test is a node process
        seen = lookups(tenant)
        assert [r["pid"] for r in seen["from-inside"]] == [container_pid]
        assert [r["pid"] for r in seen["from-node"]] == [0]
        stub.release()


# -- what the pod can do to the helper's process in its PID namespace (issue 34) ----------

PREY = f"{broker_rig.ATTACKER_DIR}/prey.py"
ROUNDS = 200
# What reaches inside the process: its memory, environment, descriptors, root, namespaces.
INSIDE = ("ptrace", "fd-readlink", "fd-open", "fdinfo", "root", "cwd", "mem", "environ", "ns",
          "pidfd_getfd")
HOST_USERS = [True, False]
HOST_USERS_IDS = ["hostUsers-true", "hostUsers-false"]


def tenant(runc: oci.Runc, allocation: api.ContainerAllocateResponse, host_users: bool,
           name: str) -> oci.RuncContainer:
    """A pod's root with containerd's default capabilities (CAP_KILL, CAP_SETUID...) and
    the real RuntimeDefault rules; with ``host_users`` False, in a user namespace."""
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=allocation,
                                   seccomp=profiles.runtime_default(), tmpfs=("/mnt",),
                                   binds=[broker_rig.attacker_bind()], host_users=host_users)
    return runc.create(oci.build_spec(request), name).start()


def prey(container: oci.RuncContainer, mode: str, rounds: int = ROUNDS,
         *extra: str) -> dict[str, Any]:
    result = container.exec("python3", PREY, mode, str(rounds), "/mnt/prey", *extra,
                            timeout=600)
    assert result.returncode == 0, result.output
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def worked(found: dict[str, Any], *probes: str) -> dict[str, int]:
    """How often each of ``probes`` worked, for those that ever did."""
    return {p: found["probes"][p]["ok"] for p in probes
            if found["probes"].get(p, {}).get("ok")}


def never_met(found: dict[str, Any], *probes: str) -> list[str]:
    """The probes that never reached a live process (each time it had exited already:
    ESRCH, ENOENT), so proved nothing."""
    return [p for p in probes
            if not set(found["probes"].get(p, {})) - {"ESRCH", "ENOENT"}]


@pytest.mark.parametrize("host_users", HOST_USERS, ids=HOST_USERS_IDS)
def test_the_pod_cannot_look_inside_the_helpers_process(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse,
        runc: oci.Runc, host_users: bool) -> None:
    """The pod's root watches its PID namespace while it mounts, and at each helper
    process it catches tries ptrace, /proc/PID/{fd,fdinfo,root,cwd,mem,environ,ns} and
    pidfd_getfd: nothing of it opens, and the process holds nothing but the pod's own
    /dev/fuse and the context of the mount being made. In a user namespace the pod may
    not even signal it: its credentials are the node's."""
    found = prey(tenant(runc, broker_allocation, host_users, "prey"), "look")
    print(f"\n[look, hostUsers: {str(host_users).lower()}] {found}")
    assert found["caught"] > 0, found
    assert never_met(found, *INSIDE, "signal", "prlimit", "renice") == [], found
    assert found["answers"]["counts"] == {"ok": ROUNDS}, found["answers"]
    # setpriority: the step's capabilities are not a subset of the pod's (commoncap).
    assert worked(found, *INSIDE, "renice") == {}, found
    if host_users:
        # The pod's root is the node's uid 0, as the step is: the kernel lets the same ids
        # signal it and read (or set) its limits, which can only end the pod's own
        # request, and list the numbers of its descriptors.
        assert found["fds"] is not None, found
        assert found["fds"] <= 2, found
    else:
        assert worked(found, "signal", "prlimit", "fd-list") == {}, found


def helpers_left(broker: BrokerProcess, container: oci.RuncContainer) -> list[int]:
    """Processes of this broker's helper program still alive: the broker's children and
    theirs, orphans, and any in the container's PID namespace."""
    program = str(broker.shim.parent / "fuse-broker-helper")
    tenant_ns = os.stat(f"/proc/{container.pid}/ns/pid").st_ino
    parents: dict[int, int] = {}
    ours: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text()
                                           .rsplit(")", 1)[1].split()[1])
            if os.readlink(entry / "exe") == program:
                ours.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    left = []
    for pid in ours:
        chain: list[int] = []
        up = pid
        while up > 1 and len(chain) < 64:
            up = parents.get(up, 0)
            chain.append(up)
        try:
            in_tenant = os.stat(f"/proc/{pid}/ns/pid").st_ino == tenant_ns
        except OSError:
            continue
        if broker.pid in chain or chain[:1] in ([0], [1]) or in_tenant:
            left.append(pid)
    return left


@pytest.mark.parametrize("mode", ["stop", "kill"])
@pytest.mark.parametrize("host_users", HOST_USERS, ids=HOST_USERS_IDS)
def test_a_signal_from_the_pod_ends_at_most_its_own_request(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse,
        runc: oci.Runc, host_users: bool, mode: str) -> None:
    """The pod's root SIGSTOPs (or SIGKILLs) every helper process it catches in its PID
    namespace while it mounts, and a neighbour pod mounts meanwhile. In a user namespace
    the kernel refuses each signal (the process's credentials are the node's). The node's
    uid 0 may signal it: a stopped step is seen at once and given up, a killed one too;
    either fails that one request, answered with why, at once (not at the broker's
    deadline); nothing is left behind, and the neighbour's mounts all work."""
    attacker = tenant(runc, broker_allocation, host_users, "prey")
    neighbour = tenant(runc, broker_allocation, True, "neighbour")
    calm = subprocess.Popen(runc.command("exec", neighbour.id, "python3", PREY, "none",
                                         str(ROUNDS), "/mnt/calm"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    found = prey(attacker, mode, ROUNDS, "--hits", "20")
    print(f"\n[{mode}, hostUsers: {str(host_users).lower()}] {found}")
    out, _ = calm.communicate(timeout=600)
    assert calm.returncode == 0, out
    assert json.loads(out)["answers"]["counts"] == {"ok": ROUNDS}
    assert found["caught"] > 0, found
    landed = found["probes"][mode].get("ok", 0)
    counts = found["answers"]["counts"]
    if host_users:
        assert landed > 0, found
        assert set(counts) <= {"ok", "error"}, found["answers"]  # each one answered
        assert counts.get("error", 0) <= landed, found["answers"]
        odd = [m for m in found["answers"]["messages"]
               if "in the caller's PID namespace was" not in m]
        assert odd == [], found["answers"]
    else:
        assert landed == 0, found
        assert counts == {"ok": ROUNDS}, found["answers"]
    assert broker.events("broker.stalled") == []
    assert attacker.mounts() == []
    waiting.wait_for(lambda: not helpers_left(broker, attacker), 30,
                     "every helper process to be gone",
                     detail=lambda: str(helpers_left(broker, attacker)))
    # The quota the signalled requests held is free: the pod mounts again.
    assert prey(attacker, "none", 3)["answers"]["counts"] == {"ok": 3}
