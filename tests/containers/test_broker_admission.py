"""Admission that reserves (issue 34): the mount caps count the requests in flight.

The caps (``--max-mounts`` per container, ``--max-mounts-pod``, ``--max-mounts-node``)
were checked against the records of finished mounts only, so requests that arrived
together all passed the same check: three containers of one pod asking at once with caps
2, 4 and 6 ended with 6, 5 and 5 mounts for a pod share of 4, and a neighbour pod was
refused "the node already holds 6 FUSE mounts". Now a request takes its slot when it is
admitted and gives it back however it ends (``fuse_plugin/broker/admission.py``).

Here the containers of an over-asking pod (nested in one pod cgroup, as the kubelet
makes them) and of two neighbour pods ask at once, round after round: each container
connects all its requests before any is sent, so the broker has them all before any
helper has finished. The neighbours ask for exactly what the node has left beside the
over-asker's share. In every round no container, pod or the node holds more than its
cap (counted in the containers' mount tables, from the node), the over-asking pod is
refused by the caps and still gets its share (no slot leaks from one round to the
next), and every neighbour request is served.

And a mount the broker unmounted leaves the node's count at once, not at the next
periodic check of the records.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import shares
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import BrokerProcess, Burst, attack

MAX_MOUNTS, POD_SHARE, NODE_CAP = 2, 4, 8
ROUNDS = 10
DIRECTORY = "/mnt/burst"
# The over-asking pod: containers, and the mounts each asks for at once (more than its
# --max-mounts; together more than the pod's share, within its open-request share).
GREEDY = (4, MAX_MOUNTS + 1)
# The neighbours ask for what the node has beside the greedy pod's share: a pod of two
# containers asking for one each, and a container outside any pod cgroup asking for two.
NEIGHBOURS = ((2, 1), (1, 2))


@pytest.fixture
def capped(broker_dir: Path, tmp_path: Path) -> Iterator[BrokerProcess]:
    broker = BrokerProcess(broker_dir, tmp_path / "broker", broker_rig.shim(),
                           "--max-mounts", str(MAX_MOUNTS), "--max-mounts-pod",
                           str(POD_SHARE), "--max-mounts-node", str(NODE_CAP))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def tenant_spec(allocation: api.ContainerAllocateResponse) -> oci.Spec:
    """A broker-mode container with the toolkit, under the runtime-default rules."""
    return oci.build_spec(oci.ContainerRequest(
        args=workloads.HOLD, allocation=allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind()]))


@dataclass
class Tenant:
    """One container, the pod it counts in (its pod cgroup, or itself when it is in
    none) and how many mounts it asks for in each round."""

    container: oci.RuncContainer
    pod: str
    asks: int
    greedy: bool

    def held(self) -> int:
        """Its FUSE mounts under the burst directory, in its mount table as the node
        reads it (``/proc/PID/mountinfo``): what the kernel holds, whatever the broker
        answered."""
        return sum(1 for point, _ in self.container.mounts()
                   if point.startswith(DIRECTORY + "/"))


def tenants(runc: oci.Runc, spec: oci.Spec) -> list[Tenant]:
    """The greedy pod's containers, then the neighbours'."""
    made: list[Tenant] = []
    for greedy, (count, asks) in ((True, GREEDY), *((False, n) for n in NEIGHBOURS)):
        # A pod cgroup as the kubelet names one; a lone container is a pod of its own.
        pod = f"fuse-e2e-pod{uuid.uuid4().hex[:12]}" if count > 1 else None
        for i in range(count):
            container = runc.create(spec, f"t{len(made)}{'g' if greedy else 'n'}{i}",
                                    pod=pod).start()
            container.sh(f"mkdir -p {DIRECTORY}").check()
            made.append(Tenant(container, pod or container.id, asks, greedy))
    return made


def one_round(everyone: list[Tenant]) -> list[tuple[Tenant, dict[str, Any], int]]:
    """Every container asks at once; (tenant, its tally, the mounts it then holds)."""
    bursts = [Burst(t.container, t.asks, DIRECTORY) for t in everyone]
    try:
        for burst in bursts:
            burst.line()  # ready: its /dev/fuse opened, its mountpoints made
        for burst in bursts:
            burst.go()
        outcomes = [burst.line() for burst in bursts]
        return [(t, o, t.held()) for t, o in zip(everyone, outcomes, strict=True)]
    finally:
        for burst in bursts:
            burst.release()


def over_the_caps(outcome: list[tuple[Tenant, dict[str, Any], int]]) -> list[str]:
    """What went wrong in one round: every cap exceeded, every neighbour refused, every
    refusal of the greedy pod that is not a cap's, a greedy pod never refused or short
    of its share (a slot never given back), a container whose own count of its mounts
    is not the node's, or mounts left from the round before."""
    wrong: list[str] = []
    pods: dict[str, int] = {}
    for tenant, tally, held in outcome:
        name = tenant.container.id
        pods[tenant.pod] = pods.get(tenant.pod, 0) + held
        if tally["before"]:
            wrong.append(f"{name} still held {tally['before']} mounts of the last round")
        if tally["mounted"] != held:
            wrong.append(f"{name} saw {tally['mounted']} mounts, the node {held}")
        if held > MAX_MOUNTS:
            wrong.append(f"{name} holds {held} mounts, past --max-mounts {MAX_MOUNTS}")
        refusals: dict[str, int] = tally["messages"]
        if not tenant.greedy and tally["counts"] != {"ok": tenant.asks}:
            wrong.append(f"neighbour {name} was refused: {refusals}")
        if tenant.greedy and any("--max-mounts" not in m for m in refusals):
            wrong.append(f"greedy {name} was refused other than by a cap: {refusals}")
    for pod, held in pods.items():
        if held > POD_SHARE:
            wrong.append(f"pod {pod} holds {held} mounts, past --max-mounts-pod {POD_SHARE}")
    greedy = {t.pod for t, _, _ in outcome if t.greedy}
    if any(pods[p] != POD_SHARE for p in greedy):
        wrong.append(f"the greedy pod got {[pods[p] for p in greedy]}, not its share")
    if not any(tally["messages"] for t, tally, _ in outcome if t.greedy):
        wrong.append("the greedy pod was never refused")
    if sum(pods.values()) > NODE_CAP:
        wrong.append(f"the node holds {sum(pods.values())} mounts, past "
                     f"--max-mounts-node {NODE_CAP}")
    return wrong


def test_mounts_in_flight_count_against_every_cap(
        capped: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    assert GREEDY[0] * GREEDY[1] <= shares.PER_POD  # refused by the caps, never "busy"
    assert POD_SHARE + sum(n * asks for n, asks in NEIGHBOURS) == NODE_CAP
    spec = tenant_spec(broker_allocation)
    with oci.Runc() as runc:
        everyone = tenants(runc, spec)
        wrong = [f"round {n}: {what}" for n in range(ROUNDS)
                 for what in over_the_caps(one_round(everyone))]
    assert not wrong, "\n".join(wrong)


def test_a_mount_the_broker_unmounted_counts_no_more(
        broker_dir: Path, tmp_path: Path,
        broker_allocation: api.ContainerAllocateResponse) -> None:
    """A full node, then one pod unmounts its mounts through the broker and asks nothing
    more: the node's count falls at once, so a neighbour is served (the records of the
    unmounted mounts were counted until the next periodic prune)."""
    broker = BrokerProcess(broker_dir, tmp_path / "broker", broker_rig.shim(),
                           "--max-mounts", "2", "--max-mounts-pod", "2",
                           "--max-mounts-node", "4").start()
    spec = tenant_spec(broker_allocation)
    try:
        with oci.Runc() as runc:
            leaving, staying, newcomer = (runc.create(spec, name).start()
                                          for name in ("leaving", "staying", "newcomer"))
            for tenant in (leaving, staying):
                taken = attack(tenant, "ask", "--fuse", "--repeat", "2", "--mkdir",
                               "op=mount", "path=/mnt/u/{i}")
                assert taken["counts"] == {"ok": 2}, taken
            newcomer.sh("mkdir -p /mnt/n").check()
            full = attack(newcomer, "ask", "--fuse", "op=mount", "path=/mnt/n")
            assert "the node already holds 4 FUSE mounts" in full["message"], full
            gone = attack(leaving, "ask", "--repeat", "2", "op=unmount", "path=/mnt/u/{i}")
            assert gone["counts"] == {"ok": 2}, gone
            served = attack(newcomer, "ask", "--fuse", "op=mount", "path=/mnt/n")
            assert served["status"] == "ok", served
    finally:
        broker.stop()
