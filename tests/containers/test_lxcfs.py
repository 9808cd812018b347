"""lxcfs with its preset (CAP_SYS_ADMIN + CAP_SYS_CHROOT, the lxcfs seccomp profile) in
a memory- and cpu-limited container: a process of that cgroup reads /proc/meminfo and
/proc/cpuinfo through lxcfs and sees its limits, not the host's.

The overmount of /proc/meminfo is made in a child mount namespace (unshare -m): lxcfs
reads /proc/meminfo itself, and doing it in lxcfs's own namespace deadlocks."""

from __future__ import annotations

import os
import re
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, workloads
from tests.lib.workloads import LXCFS_MOUNT

LIMIT = 256 * 1024 * 1024
CPUSET = "0"


def _memtotal_kb(text: str) -> int:
    match = re.search(r"^MemTotal:\s+(\d+) kB$", text, re.MULTILINE)
    assert match, text
    return int(match.group(1))


def test_lxcfs_shows_the_cgroup_limits(allocation: api.ContainerAllocateResponse,
                                       runc: oci.Runc) -> None:
    host_kb = _memtotal_kb(Path("/proc/meminfo").read_text())
    assert host_kb != LIMIT // 1024, "the host has exactly the limit: pick another"
    work = workloads.lxcfs()
    spec = oci.build_spec(workloads.container_request(
        work, allocation, memory_limit=LIMIT, cpuset=CPUSET))
    container = runc.create(spec, "lxcfs").start()
    mounted = workloads.mount(container, work)
    assert (LXCFS_MOUNT, "fuse.lxcfs") in container.mounts(), mounted.output

    script = (
        f"mount --bind {LXCFS_MOUNT}/proc/meminfo /proc/meminfo && "
        f"mount --bind {LXCFS_MOUNT}/proc/cpuinfo /proc/cpuinfo && "
        "cat /proc/meminfo && echo processors=$(grep -c ^processor /proc/cpuinfo)")
    seen = container.exec("unshare", "-m", "--propagation", "private", "sh", "-c", script,
                          timeout=15).check().stdout
    assert _memtotal_kb(seen) == LIMIT // 1024, seen
    assert "processors=1\n" in seen, seen

    # lxcfs's own namespace still has the kernel's /proc/meminfo (no overmount there).
    own = container.exec("cat", "/proc/meminfo").check().stdout
    assert _memtotal_kb(own) == host_kb
    if (os.cpu_count() or 1) > 1:
        direct = container.exec("grep", "-c", "^processor", "/proc/cpuinfo").check().stdout
        assert int(direct) == os.cpu_count()

    container.exec(*work.unmount()).check()
    assert container.mounts() == []
