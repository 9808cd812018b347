"""Helpers charged to their callers (issue 34, fuse_plugin/broker/cgroups.py): which
hierarchies a helper joins its caller's cgroups in, from the broker's mount table, on
cgroup v1, a v1/v2 hybrid and cgroup v2; a broker that cannot write one does not start;
a caller whose cgroup cannot be opened is refused; and the real helper refuses a request
it could not move into its caller's cgroups, before doing anything of it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

import pytest

from fuse_plugin.broker import cgroups, frames, policy
from tests.lib import broker as broker_rig

PROC_CGROUPS_V1 = """#subsys_name	hierarchy	num_cgroups	enabled
cpuset	3	4	1
cpu	1	4	1
cpuacct	1	4	1
memory	4	805	1
devices	5	4	1
pids	8	4	1
net_cls	0	4	1
"""
PROC_CGROUPS_V2 = """#subsys_name	hierarchy	num_cgroups	enabled
cpuset	0	90	1
cpu	0	90	1
cpuacct	0	90	1
memory	0	90	1
pids	0	90	1
"""


def line(spec: str) -> str:
    """A mountinfo line from "ID ROOT POINT OPTIONS FSTYPE SUPER_OPTIONS"."""
    mount_id, root, point, options, fstype, super_options = spec.split()
    return (f"{mount_id} 1 0:{mount_id} {root} {point} {options} - {fstype} {fstype} "
            f"{super_options}")


# The node's hybrid layout (this machine's, with cpu and cpuacct co-mounted).
HYBRID = "\n".join([
    line("31 / /sys/fs/cgroup rw,relatime tmpfs rw,mode=755"),
    line("32 / /sys/fs/cgroup/cpu,cpuacct rw,relatime cgroup rw,cpu,cpuacct"),
    line("34 / /sys/fs/cgroup/cpuset rw,relatime cgroup rw,cpuset"),
    line("35 / /sys/fs/cgroup/memory rw,relatime cgroup rw,memory"),
    line("36 / /sys/fs/cgroup/devices rw,relatime cgroup rw,devices"),
    line("39 / /sys/fs/cgroup/pids rw,relatime cgroup rw,pids"),
    line("40 / /sys/fs/cgroup/systemd rw,relatime cgroup rw,name=systemd"),
    line("41 / /sys/fs/cgroup/unified rw,relatime cgroup2 rw"),
])
# What a container's runtime gives it: its own cgroup, read-only.
CONTAINER_VIEW = "\n".join([
    line("70 /kubepods/podA/c1 /sys/fs/cgroup/memory ro,nosuid cgroup rw,memory"),
    line("71 /kubepods/podA/c1 /sys/fs/cgroup/cpu,cpuacct ro,nosuid cgroup rw,cpu,cpuacct"),
    line("72 /kubepods/podA/c1 /sys/fs/cgroup/pids ro,nosuid cgroup rw,pids"),
])
V2 = line("30 / /sys/fs/cgroup rw,nosuid,nodev,noexec cgroup2 rw,nsdelegate,memory_recursiveprot")


def test_hybrid_node_charges_the_v1_hierarchies_and_not_the_empty_unified_one() -> None:
    charge = cgroups.find(HYBRID, PROC_CGROUPS_V1, unified_controllers="")
    assert charge.names == ["memory", "cpu+cpuacct", "pids"]
    by_name = {h.name: h for h in charge.hierarchies}
    assert by_name["cpu+cpuacct"].mount == "/sys/fs/cgroup/cpu,cpuacct"
    caller = cgroups.parse_proc_cgroup(
        "9:name=systemd:/\n8:pids:/pod1/c\n4:memory:/pod1/c\n1:cpu,cpuacct:/pod1/c\n0::/\n")
    assert [h.path_in(caller) for h in charge.hierarchies] == ["/pod1/c"] * 3


def test_cgroup_v2_charges_the_unified_hierarchy_once() -> None:
    charge = cgroups.find(V2, PROC_CGROUPS_V2, unified_controllers="cpuset cpu io memory pids")
    assert charge.names == [cgroups.UNIFIED]
    assert charge.hierarchies[0].mount == "/sys/fs/cgroup"
    caller = cgroups.parse_proc_cgroup("0::/kubepods.slice/pod1.slice/cri-containerd-c.scope\n")
    assert charge.hierarchies[0].path_in(caller) == \
        "/kubepods.slice/pod1.slice/cri-containerd-c.scope"


def test_a_node_without_a_controller_charges_the_rest() -> None:
    no_memory = PROC_CGROUPS_V1.replace("memory\t4\t805\t1", "memory\t0\t1\t0")
    charge = cgroups.find(HYBRID, no_memory, unified_controllers="")
    assert charge.names == ["cpu+cpuacct", "pids"]


@pytest.mark.parametrize(("mounts", "proc", "unified", "missing"), [
    (CONTAINER_VIEW, PROC_CGROUPS_V1, "", "memory, cpu, cpuacct, pids"),
    (HYBRID.replace("/sys/fs/cgroup/pids rw", "/sys/fs/cgroup/pids ro"), PROC_CGROUPS_V1, "",
     "pids"),
    (V2.replace(" rw,nosuid", " ro,nosuid"), PROC_CGROUPS_V2, "memory pids",
     "memory, pids"),
    (line("30 /../.. /sys/fs/cgroup rw cgroup2 rw"), PROC_CGROUPS_V2, "memory",
     "memory"),
], ids=["runtime's own view", "one read-only", "v2 read-only", "v2 from a namespace"])
def test_a_broker_that_cannot_write_a_charged_hierarchy_names_it(
        mounts: str, proc: str, unified: str, missing: str) -> None:
    with pytest.raises(cgroups.Unwritable, match=f"node's {missing} hierarchy: give its "
                                                 "container the node's /sys/fs/cgroup"):
        cgroups.find(mounts, proc, unified_controllers=unified)


def test_a_later_mount_on_the_same_point_is_the_one_seen() -> None:
    """A hostPath of the node's tree over the runtime's read-only view."""
    charge = cgroups.find(CONTAINER_VIEW + "\n" + HYBRID, PROC_CGROUPS_V1,
                          unified_controllers="")
    assert charge.names == ["memory", "cpu+cpuacct", "pids"]


@pytest.mark.parametrize(("text", "words"), [
    ("4:memory:/../../besteffort/pod1/c\n", "is not in the node's tree as the broker sees"),
    ("1:cpu:/pod1/c\n", r"cgroup \(none\) is not in the node.s tree"),
])
def test_a_callers_cgroup_outside_the_brokers_view_is_refused(text: str, words: str) -> None:
    memory = cgroups.Hierarchy("memory", "/sys/fs/cgroup/memory", frozenset({"memory"}))
    charge = cgroups.Charge((memory,))
    with pytest.raises(policy.Refused, match=words) as refused:
        charge.open_lines(cgroups.parse_proc_cgroup(text))
    assert refused.value.kind == "caller"
    assert "runs no helper outside its caller's cgroups" in str(refused.value)


def open_under(directory: Path) -> list[str]:
    """What this process's descriptors that point under ``directory`` point at."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [t for t in targets if t.startswith(f"{directory}/")]


def test_a_cgroup_that_cannot_be_opened_is_refused_and_nothing_stays_open(
        tmp_path: Path) -> None:
    (tmp_path / "a" / "pod1" / "c").mkdir(parents=True)
    (tmp_path / "a" / "pod1" / "c" / "cgroup.procs").write_text("")
    first = cgroups.Hierarchy("memory", str(tmp_path / "a"), frozenset({"memory"}))
    second = cgroups.Hierarchy("pids", str(tmp_path / "b"), frozenset({"pids"}))
    with pytest.raises(policy.Refused, match=r"cannot run the helper in the caller's pids "
                                             r"cgroup \(/pod1/c\): No such file"):
        cgroups.Charge((first, second)).open_lines(
            cgroups.parse_proc_cgroup("4:memory:/pod1/c\n8:pids:/pod1/c\n"))
    # The first hierarchy's cgroup.procs was opened: no descriptor of ours may still
    # point under tmp_path (counting all of the process's descriptors is not a test:
    # other tests' sockets close whenever the garbage collector runs).
    assert open_under(tmp_path) == []


def test_a_caller_that_has_exited_is_refused() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    memory = cgroups.Hierarchy("memory", "/sys/fs/cgroup/memory", frozenset({"memory"}))
    with pytest.raises(policy.Refused, match=f"the calling process {proc.pid} has exited"):
        cgroups.Charge((memory,)).open(proc.pid)


@pytest.fixture(scope="module")
def helper() -> Path:
    return broker_rig.shim().with_name("fuse-broker-helper")


def test_the_helper_refuses_a_request_it_could_not_charge_to_its_caller(
        helper: Path, tmp_path: Path) -> None:
    """A cgroup.procs it cannot write (here a file open read-only): refused before it
    does anything of the request, kind "caller"."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_only = os.open(procs, os.O_RDONLY)
    pidfd = os.pidfd_open(os.getpid())
    mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    fds = [theirs.fileno(), pidfd, mnt, read_only]
    try:
        proc = subprocess.Popen([str(helper), *map(str, fds[:3])], pass_fds=fds,
                                env=cgroups.environment([("memory", read_only)]))
        theirs.close()
        ours.send(frames.encode(frames.REQUEST, {"op": "unmount", "path": "/mnt/x",
                                                 "uid": 0, "gid": 0, "groups": ()}))
        ours.settimeout(10)
        report = frames.decode(ours.recv(frames.MAX_FRAME), frames.REPORT)
        assert proc.wait(10) == 0
    finally:
        for fd in (pidfd, mnt, read_only):
            os.close(fd)
        ours.close()
    assert report == {
        "status": "refused", "kind": "caller",
        "message": "cannot run the helper in the caller's memory cgroup: Bad file "
                   "descriptor; the broker runs no helper outside its caller's cgroups"}
    assert procs.read_text() == ""
