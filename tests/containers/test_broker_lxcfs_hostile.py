"""The LXCFS path under attack (issue 44): a tenant with what a broker-mode pod has
(containerd's default capabilities, the real RuntimeDefault rules, which allow
``unshare`` and ``mount``) against the real broker, the real lxcfs and the real
``fuse-broker-lxcfs``. Each test names the principle it proves, and each failed on main
before this change:

- **no privileged walk into tenant filesystems**: the tenant binds its own broker-made
  FUSE mount, whose daemon reads LOOKUP and never answers it, over ``/sys/devices`` in a
  mount namespace of its own, and asks for views from there. The tool walked into it and
  waited in the kernel past its SIGKILL, holding a node-wide bind slot for as long as the
  tenant liked; now the shared walk (``native/mounts.h``) refuses at the FUSE mount, the
  request is refused at once and a neighbour is served;
- **all or nothing**: a request refused at the eighth file (the tenant covered
  ``/sys/devices/system/cpu/online``) left its first seven ``/proc`` binds behind,
  unrecorded; now nothing is bound;
- **work done for a caller is charged to the caller**: the tool runs in the consumer's
  own cgroups (caught there while lxcfs is stopped), not the broker's;
- **pidfds for every process the broker acts on**: an announcement whose process has
  exited, its pid reused by another process before the broker accepted it, handed the
  broker that process's mount namespace to bind lxcfs's files from; now it is refused and
  the real lxcfs keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import lxcfs, protocol
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import ATTACKER_IN_CONTAINER, BrokerProcess, Held, attack
from tests.lib.lxcfs import LxcfsInstance, memtotal_kb
from tests.lib.waiting import wait_for

from .test_broker_lxcfs import LIMIT, WRAPPED, bound, consumer

TOOL_COMM = lxcfs.TOOL_NAME[:15]  # the kernel keeps 15 characters of a command's name
ASK = [f"v={protocol.VERSION}", f"op={lxcfs.OP}"]
NESTED_UID = "1"  # the nested namespace's root, on the node: neither root nor the pod's


def tools() -> list[int]:
    """The fuse-broker-lxcfs processes on the node."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == TOOL_COMM:
                found.append(int(entry.name))
    return found


@pytest.fixture
def tenant(broker_allocation: api.ContainerAllocateResponse, runc: oci.Runc
           ) -> oci.RuncContainer:
    """A pod's root with the runtime's defaults and the device in broker mode."""
    request = oci.ContainerRequest(args=workloads.HOLD, allocation=broker_allocation,
                                   seccomp=profiles.runtime_default(), tmpfs=("/mnt",),
                                   binds=[broker_rig.attacker_bind()])
    return runc.create(oci.build_spec(request), "lxcfs-tenant").start()


def neighbour_is_served(broker: BrokerProcess, runc: oci.Runc,
                        allocation: api.ContainerAllocateResponse) -> None:
    """A restricted neighbour started through the shim gets its views."""
    before = len(broker.events("broker.lxcfs"))
    neighbour = runc.create(oci.build_spec(consumer(allocation, WRAPPED)),
                            "lxcfs-neighbour").start()
    wait_for(lambda: bound(broker, before + 1), 20, "the neighbour's views",
             detail=broker.log)
    assert memtotal_kb(neighbour.exec("cat", "/proc/meminfo").check().stdout) == \
        LIMIT // 1024


def test_a_tenant_fuse_mount_on_the_way_is_never_walked_into(
        views_broker: BrokerProcess, node_lxcfs: LxcfsInstance, tenant: oci.RuncContainer,
        runc: oci.Runc, broker_allocation: api.ContainerAllocateResponse) -> None:
    tenant.exec("mkdir", "/mnt/stall").check()
    stall = Held(tenant, "serve", "/mnt/stall", "/mnt/record", "--never-lookup")
    assert stall.answer["status"] == "ok", stall.answer
    found = attack(tenant, "nested-ask", NESTED_UID, "/mnt/stall", "/sys/devices", *ASK)
    answer = found["answer"]
    assert answer["status"] == "error", found
    assert ("broker refused: '/sys/devices/system/cpu' is at or inside the fuse mount at "
            "'/sys/devices'") in answer["message"], answer
    assert found["lxcfs_binds"] == [], found
    # The daemon was never asked a thing by the broker's tool: no LOOKUP, no state D.
    record = Path(f"/proc/{tenant.pid}/root/mnt/record").read_text()
    assert '"name": "system"' not in record, record
    wait_for(lambda: not tools(), 10, "no fuse-broker-lxcfs left running")
    neighbour_is_served(views_broker, runc, broker_allocation)


def test_a_request_refused_at_the_last_file_binds_none(
        views_broker: BrokerProcess, node_lxcfs: LxcfsInstance,
        tenant: oci.RuncContainer) -> None:
    found = attack(tenant, "nested-ask", NESTED_UID, ATTACKER_IN_CONTAINER,
                   "/sys/devices/system/cpu/online", *ASK)
    answer = found["answer"]
    assert answer["status"] == "error", found
    assert "broker refused: /sys/devices/system/cpu/online is covered by a" in \
        answer["message"], answer
    assert found["lxcfs_binds"] == [], found


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def charged_lines(pid: int) -> set[str]:
    """The lines of /proc/PID/cgroup that account what a process uses: cgroup v1's
    memory, cpu, cpuacct and pids hierarchies, else (cgroup v2 alone) the unified one."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {line for line in lines
            if {"memory", "cpu", "cpuacct", "pids"} & set(line.split(":")[1].split(","))} \
        or {line for line in lines if line.startswith("0::")}


def test_the_bind_tool_runs_in_its_consumers_cgroups(
        views_broker: BrokerProcess, node_lxcfs: LxcfsInstance, runc: oci.Runc,
        broker_allocation: api.ContainerAllocateResponse) -> None:
    """Caught while lxcfs is stopped (the tool waits on lxcfs's files there, killable), it
    is in the consumer's memory, cpu, cpuacct and pids cgroups, none of the broker's."""
    with stopped(node_lxcfs.lxcfs_pid):
        container = runc.create(oci.build_spec(consumer(broker_allocation, WRAPPED)),
                                "lxcfs-charged").start()
        [tool] = wait_for(tools, 20, "the broker's fuse-broker-lxcfs for the consumer")
        # Its first act moves it; from then on it waits on lxcfs until its deadline.
        theirs = charged_lines(container.pid)
        wait_for(lambda: charged_lines(tool) == theirs, 3,
                 "the tool to be in the consumer's cgroups",
                 detail=lambda: f"{charged_lines(tool)} != {theirs}")
    assert not theirs & charged_lines(views_broker.pid), theirs


def impostor_at(pid: int, tries: int = 50) -> subprocess.Popen[bytes]:
    """A process in a mount namespace of its own that the kernel gives ``pid``: the pid
    namespace's next pid is set just below it (ns_last_pid), again until it lands."""
    for _ in range(tries):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["unshare", "--mount", "sleep", "300"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"pid {pid} could not be given to another process")


def test_an_announcement_whose_process_is_gone_is_refused(
        views_broker: BrokerProcess, node_lxcfs: LxcfsInstance, lxcfs_dir: Path,
        runc: oci.Runc, broker_allocation: api.ContainerAllocateResponse) -> None:
    serving = len(views_broker.events("broker.lxcfs_serving"))
    path = lxcfs_dir / lxcfs.SOCKET_NAME
    with stopped(views_broker.pid):
        announcer = subprocess.Popen(
            [sys.executable, "-c",
             "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
             "s.connect(sys.argv[1]); s.send(bytes.fromhex(sys.argv[2]))",
             str(path), protocol.encode(v=protocol.VERSION, op="serving").hex()])
        assert announcer.wait(30) == 0
        impostor = impostor_at(announcer.pid)
    try:
        wait_for(lambda: views_broker.events("broker.lxcfs_refused"), 20,
                 "the broker to refuse the announcement", detail=views_broker.log)
        refused = views_broker.events("broker.lxcfs_refused")[-1]
        assert f"process {announcer.pid} has exited" in refused["reason"], refused
        assert len(views_broker.events("broker.lxcfs_serving")) == serving
        assert not views_broker.events("broker.lxcfs_gone")
        neighbour_is_served(views_broker, runc, broker_allocation)
    finally:
        impostor.kill()
        impostor.wait()

