"""Who is asking: the process at the other end of a broker connection, named by the kernel.

Nothing the client sends names a process. ``SO_PEERCRED`` gives the uid, gid and pid that
connected; ``SO_PEERPIDFD`` (Linux 6.5+) a pidfd for exactly that process (older kernels:
``pidfd_open(pid)`` at accept). Everything else is read from ``/proc/PID`` and then the
pidfd is checked to be alive: a live pidfd means the pid was not reused in between, so
what was read belongs to the caller. Only the kernel's own tables are read here (procfs,
nsfs): nothing a tenant's filesystem could answer or stall.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import os
import signal
import socket
import struct
from dataclasses import dataclass, field

from fuse_plugin.broker import frames, policy

SO_PEERPIDFD = 77  # asm-generic value (x86, arm); Linux 6.5+
_OWN_USERNS = os.stat("/proc/self/ns/user").st_ino


@dataclass
class Caller:
    pid: int
    uid: int  # as the node sees them
    gid: int
    pidfd: int
    container: str  # the caller's container's cgroup (policy.container_of)
    groups: tuple[int, ...] = ()
    mnt_ns: int = -1  # fds for the helper
    user_ns: int = -1  # -1: the node's own user namespace
    namespace: int = 0  # the mount namespace's inode, for the log
    _fds: list[int] = field(default_factory=list)

    @property
    def node_root(self) -> bool:
        """Root on the node, outside any user namespace: fusermount3's root."""
        return self.uid == 0 and self.user_ns == -1

    def open(self) -> None:
        """Read what the request needs from /proc/PID and open the caller's namespaces,
        then prove it is still the same process; ``Refused`` if it has gone or if it is
        not a caller the broker serves."""
        try:
            root = os.readlink(f"/proc/{self.pid}/root")
            user_ino = os.stat(f"/proc/{self.pid}/ns/user").st_ino
            maps_node_root = user_ino != _OWN_USERNS and _maps_zero(self.pid)
            self.groups = _groups(self.pid)
            self.mnt_ns = self._keep(os.open(f"/proc/{self.pid}/ns/mnt",
                                             os.O_RDONLY | os.O_CLOEXEC))
            self.namespace = os.fstat(self.mnt_ns).st_ino
            if user_ino != _OWN_USERNS:
                self.user_ns = self._keep(os.open(f"/proc/{self.pid}/ns/user",
                                                  os.O_RDONLY | os.O_CLOEXEC))
        except (FileNotFoundError, ProcessLookupError):
            raise policy.Refused(f"the calling process {self.pid} has exited",
                                 "caller") from None
        except PermissionError as err:
            raise policy.Refused(f"cannot read the caller's namespaces: {err.strerror} "
                                 "(the broker needs CAP_SYS_PTRACE and host PID)",
                                 "caller") from None
        except OSError as err:
            if policy.out_of_resources(err):
                raise policy.OutOfResources(f"reading /proc/{self.pid}", err) from None
            raise
        if len(self.groups) > frames.MAX_GROUPS:
            raise policy.Refused(f"the caller has {len(self.groups)} supplementary groups; "
                                 f"the broker checks as the caller with all of them, up to "
                                 f"{frames.MAX_GROUPS}, and refuses rather than check with "
                                 "fewer", "caller")
        if not self.alive():
            raise policy.Refused(f"the calling process {self.pid} has exited", "caller")
        policy.caller(root, maps_node_root)

    def alive(self) -> bool:
        return alive(self.pidfd)

    def close(self) -> None:
        for fd in (self.pidfd, *self._fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self.pidfd = self.mnt_ns = self.user_ns = -1

    def _keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd


UCRED = "iII"


def alive(pidfd: int) -> bool:
    """Signal 0 through the pidfd: ESRCH once the process is gone. A process of another
    uid answers EPERM (the broker holds no CAP_KILL), which also says it is there."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def identify(conn: socket.socket) -> Caller:
    """The connected process, from the kernel's view of the socket."""
    # struct ucred: pid_t, then uid_t and gid_t, which are unsigned: a user-namespaced pod's
    # ids on the node are often above 2**31 (the kubelet hands out ranges up to 2**32).
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(UCRED))
    pid, uid, gid = struct.unpack(UCRED, creds)
    if pid <= 0:
        raise policy.Refused("the caller's pid is not visible (the broker needs host PID)",
                             "caller")
    pidfd = peer_pidfd(conn, pid)
    os.set_inheritable(pidfd, False)
    caller = Caller(pid=pid, uid=uid, gid=gid, pidfd=pidfd, container="")
    key = _process_key(pidfd)
    known = _CONTAINERS.get(key) if key else None
    if known is not None:  # this very process was named before: no /proc read
        _CONTAINERS.move_to_end(key)
        caller.container = known
        return caller
    try:
        caller.container = _cgroup(pid)
    except OSError as err:
        caller.close()
        if policy.out_of_resources(err):
            raise policy.OutOfResources(f"reading /proc/{pid}/cgroup", err) from None
        raise policy.Refused(f"the calling process {pid} has exited", "caller") from None
    if not caller.alive():
        caller.close()
        raise policy.Refused(f"the calling process {pid} has exited", "caller")
    if key:
        _CONTAINERS[key] = caller.container
        if len(_CONTAINERS) > CACHED_PROCESSES:
            _CONTAINERS.popitem(last=False)
    return caller


def peer_pidfd(conn: socket.socket, pid: int) -> int:
    """A pidfd for exactly the process that connected."""
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as err:
        if policy.out_of_resources(err):
            raise policy.OutOfResources("the caller's pidfd", err) from None
        if err.errno != errno.ENOPROTOOPT:  # ESRCH: the peer has exited
            raise policy.Refused(f"the calling process {pid} has exited", "caller") from None
        try:  # before Linux 6.5: the pid, taken as early as possible
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise policy.Refused(f"the calling process {pid} has exited",
                                 "caller") from None
        except OSError as err:
            if policy.out_of_resources(err):
                raise policy.OutOfResources("the caller's pidfd", err) from None
            raise
    return pidfd


# Reading /proc/PID/cgroup was a third of the broker's time per refused request (the
# kernel formats every hierarchy), and a flooding tenant asks from the same few
# processes. A process is named by its pidfd's inode, which the kernel (pidfs, Linux
# 6.9+) never gives another process, unlike its pid; a process stays in its container's
# cgroup (a tenant cannot write the cgroup tree). Bounded, least recently used first out.
CACHED_PROCESSES = 4096
_CONTAINERS: collections.OrderedDict[int, str] = collections.OrderedDict()


def _process_key(pidfd: int) -> int:
    """The process's unique inode, or 0 where pidfds share one inode (before pidfs)."""
    return os.fstat(pidfd).st_ino if _pidfd_inodes_unique() else 0


@functools.cache
def _pidfd_inodes_unique() -> bool:
    """Whether two processes' pidfds have different inodes (pidfs) or one (anon inode)."""
    own = os.pidfd_open(os.getpid())
    try:
        parent = os.pidfd_open(os.getppid())
    except OSError:  # no parent to compare with (pid 1 of a namespace): no cache
        os.close(own)
        return False
    try:
        return os.fstat(own).st_ino != os.fstat(parent).st_ino
    finally:
        os.close(own)
        os.close(parent)


def _cgroup(pid: int) -> str:
    """The caller's container (``policy.container_of``) from its cgroup: the devices
    controller's (cgroup v1: the one Allocate's rule is written in), else the unified
    one (v2), else the first listed. On a hybrid host the unified line may be "/" for
    every container, so it comes second."""
    with open(f"/proc/{pid}/cgroup") as text:
        lines = [line.split(":", 2) for line in text.read().splitlines() if line.count(":") >= 2]
    for want in (lambda c: "devices" in c.split(","), lambda c: c == ""):
        for _, controllers, path in lines:
            if want(controllers):
                return policy.container_of(path)
    return policy.container_of(lines[0][2] if lines else "/")


def _groups(pid: int) -> tuple[int, ...]:
    """Supplementary groups, as the node names them (procfs translates for its reader)."""
    with open(f"/proc/{pid}/status") as text:
        for line in text:
            if line.startswith("Groups:"):
                return tuple(int(g) for g in line.split()[1:])
    return ()


def _maps_zero(pid: int) -> bool:
    """Whether the caller's user namespace maps the node's uid 0 (uid_map's outside
    column, as read from the node's namespace)."""
    with open(f"/proc/{pid}/uid_map") as text:
        for line in text:
            _, outside, count = (int(n) for n in line.split())
            if outside <= 0 < outside + count:
                return True
    return False
