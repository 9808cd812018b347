"""Shares that hold on a full node (issue 34): however many pods a tenant runs, a pod
that keeps to its own share is served.

The node-wide caps were fixed numbers: one tenant's 64 single-container pods holding 4
silent connections each, every one within its container's and its pod's share, took
all 256 of the node's open requests, and a neighbour's requests were answered "the
broker is busy (256 requests open); try again" (10 of 10 and 8 of 10 in two runs). The
kubelet runs at most maxPods pods on a node (110 by default), so each node-wide cap is
now a pod's share times ``--max-pods`` (``fuse_plugin/broker/shares.py``).

The same held for mounts: --max-mounts-node was 1,000 and a pod's share 64, so 16 pods
at their share filled the node. Its default is now --max-mounts-pod x --max-pods.

Here the node is full to the default maxPods, with the DaemonSet's flags: 109 attacking
pods of four containers each (runc containers nested in pod cgroups, as the kubelet
makes them; containerd's default capabilities, the real RuntimeDefault rules) hold their
pod's whole share of silent connections, four a container and 16 a pod, each container
replacing every connection the broker answers at its request deadline. Then the 110th
pod, a neighbour of four containers, asks for its own whole share at once: 16 mounts in
flight together. Every one is served, and every attacking container held its four.
And 16 pods of two containers each make their pod's whole share of mounts (32 a
container, 64 a pod: 1,024 FUSE mounts), and then a neighbour mounts.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import settings, shares
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import ATTACKER_IN_CONTAINER, BrokerProcess, Burst, attack
from tests.lib.waiting import wait_for

PODS = shares.DEFAULT_MAX_PODS  # the node is full: the attackers' and the neighbour's
CONTAINERS = shares.PER_POD // shares.PER_CONTAINER  # a pod's share needs this many
DIRECTORY = "/mnt/neighbour"
SETTLE_DEADLINE = 300.0  # seconds, from the last attacker's start, for all to settle


def spec(allocation: api.ContainerAllocateResponse, args: list[str]) -> oci.Spec:
    """A broker-mode container with the toolkit, under the runtime-default rules."""
    return oci.build_spec(oci.ContainerRequest(
        args=args, allocation=allocation, seccomp=profiles.runtime_default(),
        binds=[broker_rig.attacker_bind()]))


def settled(container: oci.RuncContainer) -> dict[str, Any] | None:
    """An attacking container's report (its init, ``attacker.py keep``, writes one JSON
    line to its log once it knows which of its connections the broker holds)."""
    log = Path(container.bundle, "init.log")
    line = log.read_text().partition("\n")[0] if log.exists() else ""
    return json.loads(line) if line.endswith("}") else None


def all_settled(attackers: list[oci.RuncContainer]) -> list[dict[str, Any]] | None:
    """Every attacking container's report, once all have one."""
    reports = [settled(a) for a in attackers]
    done = [r for r in reports if r is not None]
    return done if len(done) == len(reports) else None


@pytest.mark.timeout(1200)  # 440 containers made and deleted on a 2-CPU machine
def test_a_neighbour_gets_its_share_on_a_node_full_of_pods_at_theirs(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    keep = spec(broker_allocation, ["python3", ATTACKER_IN_CONTAINER, "keep",
                                    str(shares.PER_CONTAINER)])
    with oci.Runc() as runc:
        attackers = [runc.create(keep, f"a{p}x{c}", pod=pod).start()
                     for p, pod in enumerate(f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"
                                             for _ in range(PODS - 1))
                     for c in range(CONTAINERS)]
        reports = wait_for(lambda: all_settled(attackers), SETTLE_DEADLINE,
                           "every attacking container to hold its connections",
                           interval=0.5)
        pod = f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"
        neighbours = [runc.create(spec(broker_allocation, workloads.HOLD), f"n{c}",
                                  pod=pod).start() for c in range(CONTAINERS)]
        for neighbour in neighbours:
            neighbour.sh(f"mkdir -p {DIRECTORY}").check()
        bursts = [Burst(n, shares.PER_CONTAINER, DIRECTORY) for n in neighbours]
        try:
            for burst in bursts:
                burst.line()  # ready: its /dev/fuse opened, its mountpoints made
            for burst in bursts:
                burst.go()
            outcomes = [burst.line() for burst in bursts]
        finally:
            for burst in bursts:
                burst.release()
    served = sum(o["counts"].get("ok", 0) for o in outcomes)
    refusals: Counter[str] = Counter()
    for outcome in outcomes:
        refusals.update(outcome["messages"])
    assert served == shares.PER_POD, \
        f"the neighbour got {served} of its {shares.PER_POD}: {dict(refusals)}"
    assert [o["mounted"] for o in outcomes] == [shares.PER_CONTAINER] * CONTAINERS
    short = [r for r in reports if r["held"] != shares.PER_CONTAINER]
    assert not short, f"{len(short)} attacking containers held less than their share: " \
        f"{short[:3]}"


MOUNTING_PODS = 16  # at their share of mounts: more than the old --max-mounts-node 1,000


@pytest.mark.timeout(900)
def test_a_neighbour_mounts_on_a_node_whose_pods_hold_their_share_of_mounts(
        broker: BrokerProcess, broker_allocation: api.ContainerAllocateResponse) -> None:
    per_container = settings.DEFAULT_MAX_MOUNTS
    containers = settings.DEFAULT_MAX_MOUNTS_POD // per_container
    tenant = spec(broker_allocation, workloads.HOLD)
    with oci.Runc() as runc:
        taken: list[int] = []
        for _ in range(MOUNTING_PODS):
            pod = f"fuse-e2e-pod{uuid.uuid4().hex[:12]}"
            for c in range(containers):
                member = runc.create(tenant, f"m{len(taken)}x{c}", pod=pod).start()
                result = attack(member, "ask", "--fuse", "--repeat", str(per_container),
                                "--mkdir", "op=mount", "path=/mnt/q/{i}")
                taken.append(result["counts"].get("ok", 0))
        neighbour = runc.create(tenant, "neighbour").start()
        neighbour.sh("mkdir -p /mnt/n").check()
        answer = attack(neighbour, "ask", "--fuse", "op=mount", "path=/mnt/n")
    assert answer["status"] == "ok", answer
    assert taken == [per_container] * (MOUNTING_PODS * containers)
