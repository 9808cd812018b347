"""The mount belongs to the caller's PID namespace (issue 26).

The kernel names every process that touches a FUSE mount to its daemon by its pid in
the superblock's PID namespace, which is that of the process that created it. The broker's
helper made it from the node's, so a tenant's daemon saw node pids of every process
touching its mount (a process that was PID 18 in the container arrived as 28463). Now a
child of the helper, in the caller's PID namespace, creates it: the daemon sees container
pids, and 0 for any process outside the container.

The tenant has containerd's default capabilities and the real RuntimeDefault rules; its
daemon is the toolkit's recording stub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
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
