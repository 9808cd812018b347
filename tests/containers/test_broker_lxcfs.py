"""LXCFS views through the broker (issue 36): one node-wide lxcfs, and containers with no
capability under the runtime-default seccomp rules that ask for its files over their own
/proc with ``fusermount3 --lxcfs -- CMD`` (the shim Allocate binds).

Real parts: the broker, ``fuse-device-plugin lxcfs`` running the real lxcfs in a mount
namespace of its own (``tests/lib/lxcfs.py``), runc containers built from the plugin's
broker-mode Allocate answer, and a restart of lxcfs as the kubelet restarts its
container (SIGKILL, then a fresh instance) while a consumer reads in a loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import lxcfs
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles
from tests.lib.broker import BrokerProcess, attack
from tests.lib.lxcfs import LxcfsInstance, memtotal_kb
from tests.lib.waiting import wait_for

LIMIT = 256 * 1024 * 1024
TENANT = 1000
WRAPPED = ["/usr/bin/fusermount3", "--lxcfs", "--", "sleep", "infinity"]


def consumer(allocation: api.ContainerAllocateResponse | None, args: list[str],
             **changes: object) -> oci.ContainerRequest:
    """What a restricted pod has: uid 1000, no capability, noNewPrivileges, a read-only
    root, the runtime-default seccomp rules; limited to LIMIT bytes and one CPU."""
    return oci.ContainerRequest(
        args=args, allocation=allocation, user=(TENANT, TENANT), groups=(),
        no_new_privileges=True, readonly_rootfs=True, drop_capabilities=(oci.DROP_ALL,),
        seccomp=profiles.runtime_default(()), tmpfs=("/mnt",), memory_limit=LIMIT,
        cpuset="0", **{"binds": [broker_rig.attacker_bind()], **changes})  # type: ignore[arg-type]


def bound(broker: BrokerProcess, count: int) -> bool:
    return len(broker.events("broker.lxcfs")) >= count


@pytest.mark.parametrize("host_users", [True, False], ids=["restricted", "hostUsers-false"])
def test_a_container_with_no_capability_sees_its_own_limits(
        broker_allocation: api.ContainerAllocateResponse, views_broker: BrokerProcess,
        node_lxcfs: LxcfsInstance, runc: oci.Runc, host_users: bool) -> None:
    host_kb = memtotal_kb(Path("/proc/meminfo").read_text())
    assert host_kb != LIMIT // 1024
    container = runc.create(oci.build_spec(consumer(broker_allocation, WRAPPED,
                                                    host_users=host_users)),
                            "lxcfs-consumer").start()
    wait_for(lambda: bound(views_broker, 1), 20, "the broker to bind the views",
             detail=views_broker.log)
    status = container.exec("grep", "-E", "^(CapEff|NoNewPrivs|Seccomp):",
                            "/proc/self/status").check().stdout
    assert "CapEff:\t0000000000000000" in status
    assert "Seccomp:\t2" in status

    assert memtotal_kb(container.exec("cat", "/proc/meminfo").check().stdout) == LIMIT // 1024
    assert container.exec("grep", "-c", "^processor", "/proc/cpuinfo").check().stdout \
        .strip() == "1"
    assert container.exec("cat", "/sys/devices/system/cpu/online").check().stdout \
        .strip() == "0"
    own = float(container.exec("cat", "/proc/uptime").check().stdout.split()[0])
    host = float(Path("/proc/uptime").read_text().split()[0])
    assert own < host, (own, host)
    # The workload is the wrapper's command (exec): the container's init is sleep.
    assert Path(f"/proc/{container.pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
    # Exactly the files, and every one is lxcfs's.
    points = sorted(line.split()[4] for line in
                    Path(f"/proc/{container.pid}/mountinfo").read_text().splitlines()
                    if " - fuse.lxcfs " in line)
    assert points == sorted(lxcfs.FILES)
    # The host's own files are untouched.
    assert memtotal_kb(Path("/proc/meminfo").read_text()) == host_kb


def test_reads_resume_after_lxcfs_is_killed_and_restarted(
        broker_allocation: api.ContainerAllocateResponse, views_broker: BrokerProcess,
        node_lxcfs: LxcfsInstance, runc: oci.Runc) -> None:
    reader = ("i=0; while :; do i=$((i+1)); "
              "if v=$(grep MemTotal /proc/meminfo 2>&1); then echo \"$i ok $v\"; "
              "else echo \"$i fail $v\"; fi; sleep 0.05; done > /mnt/reads")
    container = runc.create(oci.build_spec(consumer(
        broker_allocation, ["/usr/bin/fusermount3", "--lxcfs", "--", "sh", "-c", reader])),
        "lxcfs-reader").start()
    wait_for(lambda: bound(views_broker, 1), 20, "the broker to bind the views",
             detail=views_broker.log)
    reads = Path(f"/proc/{container.pid}/root/mnt/reads")
    init = container.pid

    def lines() -> list[str]:
        return reads.read_text().splitlines() if reads.exists() else []

    wait_for(lambda: any(" ok " in line for line in lines()), 20, "a first read")
    assert node_lxcfs.kill_lxcfs() == 1  # the command ends with lxcfs
    wait_for(lambda: any(" fail " in line for line in lines()), 20,
             "a read to fail while no lxcfs serves", detail=lambda: "\n".join(lines()[-5:]))
    failed = next(line for line in lines() if " fail " in line)
    assert "Transport endpoint is not connected" in failed, failed

    node_lxcfs.start()  # the kubelet's restart: a fresh namespace, a fresh lxcfs
    wait_for(lambda: views_broker.events("broker.lxcfs_healed"), 20,
             "the broker to heal the consumer", detail=views_broker.log)
    last_fail = max(n for n, line in enumerate(lines()) if " fail " in line)
    wait_for(lambda: any(" ok " in line for line in lines()[last_fail + 1:]), 20,
             "reads to resume", detail=lambda: "\n".join(lines()[-5:]))
    resumed = next(line for line in lines()[last_fail + 1:] if " ok " in line)
    assert f"{LIMIT // 1024} kB" in resumed, resumed
    # No restart: the same process, whose loop counted on through the outage.
    assert Path(f"/proc/{init}").exists()
    assert int(resumed.split()[0]) > int(failed.split()[0])
    # One consumer, healed once; its stale binds replaced, not stacked.
    assert len(views_broker.events("broker.lxcfs_healed")) == 1
    stacked = [line for line in Path(f"/proc/{init}/mountinfo").read_text().splitlines()
               if " - fuse.lxcfs " in line]
    assert len(stacked) == len(lxcfs.FILES), stacked


def test_a_consumer_that_exits_is_dropped(
        broker_allocation: api.ContainerAllocateResponse, views_broker: BrokerProcess,
        node_lxcfs: LxcfsInstance, runc: oci.Runc) -> None:
    container = runc.create(oci.build_spec(consumer(broker_allocation, WRAPPED)),
                            "lxcfs-leaver").start()
    wait_for(lambda: bound(views_broker, 1), 20, "the broker to bind the views")
    container.delete()
    wait_for(lambda: views_broker.events("broker.lxcfs_consumer_gone"), 20,
             "the broker to drop the consumer", detail=views_broker.log)
    node_lxcfs.kill_lxcfs()
    node_lxcfs.start()
    wait_for(lambda: views_broker.events("broker.lxcfs_serving")[1:], 20,
             "the second lxcfs to be served")
    assert views_broker.events("broker.lxcfs_serving")[-1]["healing"] == 0
    assert not views_broker.events("broker.lxcfs_healed")


def test_no_lxcfs_is_waited_for_then_refused(
        broker_allocation: api.ContainerAllocateResponse, views_broker: BrokerProcess,
        lxcfs_dir: Path, runc: oci.Runc, tmp_path: Path) -> None:
    container = runc.create(oci.build_spec(consumer(broker_allocation, ["sleep", "infinity"])),
                            "lxcfs-early").start()
    early = container.exec("/usr/bin/fusermount3", "--lxcfs", "--", "echo", "ran",
                           env={"FUSE_BROKER_WAIT": "1"})
    assert early.returncode == 1
    assert "ran" not in early.stdout
    assert "no lxcfs serves on this node" in early.stderr
    assert "waiting up to 1 s for it" in early.stderr
    # A pod that starts before lxcfs waits, and goes on once lxcfs is there.
    late = LxcfsInstance(lxcfs_dir, tmp_path / "lxcfs-late")
    waiting = container.exec("/usr/bin/fusermount3", "--lxcfs", "--", "echo", "ran",
                             detach=True)
    assert waiting.returncode == 0
    try:
        late.start()
        wait_for(lambda: bound(views_broker, 1), 40, "the waiting request to be bound",
                 detail=views_broker.log)
    finally:
        late.stop()


def test_the_request_binds_nothing_else_anywhere_else(
        broker_allocation: api.ContainerAllocateResponse, views_broker: BrokerProcess,
        node_lxcfs: LxcfsInstance, runc: oci.Runc) -> None:
    host_kb = memtotal_kb(Path("/proc/meminfo").read_text())
    tenant = runc.create(oci.build_spec(consumer(broker_allocation, ["sleep", "infinity"])),
                         "lxcfs-tenant").start()
    neighbour = runc.create(oci.build_spec(consumer(broker_allocation, ["sleep", "infinity"])),
                            "lxcfs-neighbour").start()
    # The raw protocol: any field beyond v and op is refused, whatever it names.
    for extra in ("path=/etc/passwd", "options=rw", "fuse_fd=0", "mount_id=1",
                  "target=/proc/1/root/proc/meminfo", "pid=1", "container=/"):
        answer = attack(tenant, "ask", "op=lxcfs", extra)
        assert answer["status"] == "error", (extra, answer)
        assert "takes no field but v and op" in answer["message"], answer
    answer = attack(tenant, "ask", "op=lxcfs", "v=2")  # a second v: not even read as lxcfs
    assert answer["status"] == "error", answer
    # Nothing was bound anywhere by those.
    assert not views_broker.events("broker.lxcfs")
    for container in (tenant, neighbour):
        assert not [line for line in Path(f"/proc/{container.pid}/mountinfo").read_text()
                    .splitlines() if " - fuse.lxcfs " in line]
    # A well-formed request binds into the caller's namespace only.
    assert attack(tenant, "ask", "op=lxcfs")["status"] == "ok"
    assert memtotal_kb(tenant.exec("cat", "/proc/meminfo").check().stdout) == LIMIT // 1024
    assert memtotal_kb(neighbour.exec("cat", "/proc/meminfo").check().stdout) == host_kb
    assert memtotal_kb(Path("/proc/meminfo").read_text()) == host_kb
    # A container that was not given the device but reaches the socket (bound in by
    # hand, as a sibling sharing the pod's PID namespace reaches it through /proc):
    # refused, nothing bound.
    outsider = runc.create(oci.build_spec(consumer(
        None, ["sleep", "infinity"],
        binds=[broker_rig.attacker_bind(),
               oci.Bind(views_broker.directory, "/var/tmp/broker", True)])),
        "lxcfs-outsider").start()
    answer = attack(outsider, "ask", "op=lxcfs",
                    env={"FUSE_BROKER_SOCKET": "/var/tmp/broker/broker.sock"})
    assert answer["status"] == "error", answer
    assert "not given broker mode" in answer["message"], answer
    assert memtotal_kb(outsider.exec("cat", "/proc/meminfo").check().stdout) == host_kb


def test_a_restarted_broker_still_heals_its_consumers(
        broker_allocation: api.ContainerAllocateResponse, views_broker: BrokerProcess,
        node_lxcfs: LxcfsInstance, runc: oci.Runc) -> None:
    """The consumers' records outlive the broker (its state directory): after a broker
    restart, the next lxcfs restart heals the consumer recorded by the old broker."""
    container = runc.create(oci.build_spec(consumer(broker_allocation, WRAPPED)),
                            "lxcfs-kept").start()
    wait_for(lambda: bound(views_broker, 1), 20, "the broker to bind the views")
    views_broker.stop()
    views_broker.start()
    loaded = views_broker.events("broker.lxcfs_consumers_loaded")
    assert loaded, views_broker.log()
    assert loaded[-1]["count"] == 1
    wait_for(lambda: len(views_broker.events("broker.lxcfs_serving")) >= 2, 20,
             "lxcfs to announce itself to the new broker", detail=views_broker.log)
    node_lxcfs.kill_lxcfs()
    assert "Transport endpoint is not connected" in container.exec(
        "cat", "/proc/meminfo").stderr
    node_lxcfs.start()
    wait_for(lambda: views_broker.events("broker.lxcfs_healed"), 20,
             "the new broker to heal the old broker's consumer", detail=views_broker.log)
    assert memtotal_kb(container.exec("cat", "/proc/meminfo").check().stdout) == LIMIT // 1024
