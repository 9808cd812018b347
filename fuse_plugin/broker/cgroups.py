"""Helpers charged to their callers: each helper runs in its caller's cgroups.

A helper's memory (its pages, its kernel stack, what the kernel allocates for it: the
caller's groups, the dentries of its walk, the new mount's structures) is charged to
the memory cgroup of the task that allocates it, and its CPU time to that task's CPU
cgroup. Left in the broker's cgroups, every tenant's helpers would spend the broker's
memory limit and CPU request, so a tenant could push the broker toward its own
limit and slow every neighbour's mount. So the helper's first act, before it reads its
request, is to move itself into the caller's cgroup in each hierarchy that holds a
controller in ``CHARGED`` (``native/helper.c``, join_cgroups): the caller's own
cgroup, its container's on a node (a leaf: cgroup v2 puts processes in leaves only, and
a pod's cgroup has its containers below it), so the pod's limits, which hold its
containers', bound it too. What it allocates from then on, and the agent and step it
forks, are the caller's; what exec allocated before (a few pages, its kernel stack)
stays the broker's until it exits.

The broker opens the ``cgroup.procs`` files (its credentials and cgroup namespace are
the ones the kernel checks a move against) and hands them to the helper; the move
itself, which may wait for an RCU grace period, happens in the helper's time, never
the loop's. A request whose helper cannot be placed is refused, never run in the
broker's cgroups (docs/security.md, "Helpers are charged to their callers").

The broker must see the node's whole hierarchies, writable: in its DaemonSet a hostPath
of the node's /sys/fs/cgroup (cgroup v1 or v2), and, where the runtime gives the
container a cgroup namespace of its own (cgroup v2), the node's cgroup namespace, which
the broker joins at start (``enter_node_namespace``) so that /proc/PID/cgroup names
every caller's cgroup from the node's root.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin.broker import kernel, mountinfo, policy

# The controllers that account what a process uses: memory, CPU time (cpuacct is its
# cgroup v1 accounting twin) and the process count (the agent and the step are forks).
CHARGED = ("memory", "cpu", "cpuacct", "pids")
# How the broker names the cgroup.procs fds it passes: "memory=7 cpu+cpuacct=8 ...".
ENV = "FUSE_BROKER_CGROUPS"
CLONE_NEWCGROUP = 0x02000000
UNIFIED = "unified"  # the cgroup v2 hierarchy's name here


class Unwritable(Exception):
    """The node has a charged controller whose hierarchy the broker cannot write."""


@dataclass(frozen=True)
class Hierarchy:
    """One hierarchy holding charged controllers, where the broker sees its root."""

    name: str  # its charged controllers joined by "+", or UNIFIED
    mount: str
    controllers: frozenset[str]  # cgroup v1: every controller it holds; v2: empty

    def path_in(self, lines: Sequence[tuple[str, str]]) -> str | None:
        """The process's cgroup in this hierarchy, from /proc/PID/cgroup's
        (controllers, path) pairs."""
        for controllers, path in lines:
            if ((self.name == UNIFIED and controllers == "")
                    or self.controllers & set(controllers.split(","))):
                return path
        return None


@dataclass(frozen=True)
class Charge:
    """The hierarchies a helper joins its caller's cgroups in."""

    hierarchies: tuple[Hierarchy, ...]

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hierarchies]

    def open(self, pid: int) -> list[tuple[str, int]]:
        """The caller's ``cgroup.procs`` in each hierarchy, open for writing (by name);
        ``policy.Refused`` if one cannot be, with nothing left open. Checked alive by the
        caller of this (``Caller.alive``) after: a pid is not reused while its pidfd
        lives, so these are the caller's."""
        if not self.hierarchies:  # no accounting controller on the node: nothing to join
            return []
        try:
            with open(f"/proc/{pid}/cgroup") as text:
                lines = parse_proc_cgroup(text.read())
        except OSError as err:
            if policy.out_of_resources(err):
                raise policy.OutOfResources(f"reading /proc/{pid}/cgroup", err) from None
            raise policy.Refused(f"the calling process {pid} has exited", "caller") from None
        return self.open_lines(lines)

    def open_lines(self, lines: Sequence[tuple[str, str]]) -> list[tuple[str, int]]:
        """``open`` from /proc/PID/cgroup's (controllers, path) pairs."""
        opened: list[tuple[str, int]] = []
        try:
            for hierarchy in self.hierarchies:
                opened.append((hierarchy.name, _open_procs(hierarchy, lines)))
        except BaseException:
            close(opened)
            raise
        return opened


def _open_procs(hierarchy: Hierarchy, lines: Sequence[tuple[str, str]]) -> int:
    path = hierarchy.path_in(lines)
    if path is None or not path.startswith("/") or "/.." in path:
        raise policy.Refused(
            f"the caller's {hierarchy.name} cgroup ({(path or 'none')[:200]}) is not in "
            "the node's tree as the broker sees it; the broker runs no helper outside "
            "its caller's cgroups", "caller")
    try:
        return os.open(f"{hierarchy.mount}{path.rstrip('/')}/cgroup.procs",
                       os.O_WRONLY | os.O_CLOEXEC)
    except OSError as err:
        if policy.out_of_resources(err):
            raise policy.OutOfResources(f"opening the caller's {hierarchy.name} cgroup",
                                        err) from None
        raise policy.Refused(
            f"cannot run the helper in the caller's {hierarchy.name} cgroup "
            f"({path[:200]}): {err.strerror}; the broker runs no helper outside its "
            "caller's cgroups", "caller") from None


def close(opened: Iterable[tuple[str, int]]) -> None:
    for _, fd in opened:
        with contextlib.suppress(OSError):
            os.close(fd)


def environment(opened: Sequence[tuple[str, int]]) -> dict[str, str]:
    """The helper's environment: which inherited fd is which hierarchy's."""
    return {ENV: " ".join(f"{name}={fd}" for name, fd in opened)}


def parse_proc_cgroup(text: str) -> list[tuple[str, str]]:
    """(controllers, path) of each line of /proc/PID/cgroup ("" for cgroup v2)."""
    out = []
    for line in text.splitlines():
        _, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if sep and sep2:
            out.append((controllers, path))
    return out


def find(mounts: str, proc_cgroups: str, unified_controllers: str | None) -> Charge:
    """The hierarchies to charge helpers in, from the broker's mountinfo, /proc/cgroups
    and (cgroup v2) the unified root's cgroup.controllers; ``Unwritable`` naming the
    controllers on the node whose whole hierarchy the broker cannot write."""
    entries = mountinfo.parse(mounts)
    v1: set[str] = set()  # enabled charged controllers on a v1 hierarchy (id > 0)
    v2: set[str] = set()  # and on none: cgroup v2's, if its root lists them
    for line in proc_cgroups.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[0] in CHARGED and fields[3] == "1":
            (v2 if fields[1] == "0" else v1).add(fields[0])
    v2 &= set((unified_controllers or "").split())
    hierarchies: dict[str, Hierarchy] = {}
    missing = []
    for controller in sorted(v1, key=CHARGED.index):
        found = _whole(e for e in entries if e.fstype == "cgroup"
                       and controller in e.super_options.split(","))
        if found is None:
            missing.append(controller)
            continue
        held = frozenset(found.super_options.split(",")) - {"rw", "ro"}
        name = "+".join(c for c in CHARGED if c in held)
        hierarchies.setdefault(name, Hierarchy(name, found.mountpoint.rstrip("/"), held))
    if v2:
        found = _whole(e for e in entries if e.fstype == "cgroup2")
        if found is None:
            missing.extend(sorted(v2, key=CHARGED.index))
        else:
            hierarchies[UNIFIED] = Hierarchy(UNIFIED, found.mountpoint.rstrip("/"),
                                             frozenset())
    if missing:
        raise Unwritable(
            f"the broker runs each helper in its caller's cgroups and cannot write the "
            f"node's {', '.join(missing)} hierarchy: give its container the node's "
            "/sys/fs/cgroup, writable (manifests/broker/broker-daemonset.yaml's hostPath "
            "`cgroup`)")
    return Charge(tuple(hierarchies.values()))


def _whole(candidates: Iterable[mountinfo.Entry]) -> mountinfo.Entry | None:
    """The last writable mount of a hierarchy's root (a later mount on the same point
    hides an earlier one; a runtime's own cgroup mount shows only the container's
    cgroup, and read-only)."""
    best = None
    for entry in candidates:
        if entry.root == "/" and "rw" in entry.options.split(","):
            best = entry
    return best


def node_charge() -> Charge:
    """``find`` on this process's view (after ``enter_node_namespace``)."""
    with open("/proc/self/mountinfo") as mounts, open("/proc/cgroups") as listed:
        table, proc_cgroups = mounts.read(), listed.read()
    unified = None
    for entry in mountinfo.parse(table):
        if entry.fstype == "cgroup2":
            with contextlib.suppress(OSError):
                unified = Path(entry.mountpoint, "cgroup.controllers").read_text()
    return find(table, proc_cgroups, unified)


def enter_node_namespace() -> bool:
    """Join the node's cgroup namespace (pid 1's, with host PID) when the broker's
    differs (containerd gives a cgroup v2 container one of its own), so that callers'
    cgroups are named, and moves into them judged, from the node's root. False when it
    already is there, or cannot tell (pid 1's namespace unreadable: not a node's init)."""
    try:
        node = os.stat("/proc/1/ns/cgroup").st_ino
    except OSError:
        return False
    if node == os.stat("/proc/self/ns/cgroup").st_ino:
        return False
    fd = os.open("/proc/1/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC)
    try:
        kernel.setns(fd, CLONE_NEWCGROUP)
    finally:
        os.close(fd)
    return True
