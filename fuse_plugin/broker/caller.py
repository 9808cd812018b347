"""Who is asking: the process at the other end of a broker connection, named by the kernel.

Nothing the client sends names a process. ``SO_PEERCRED`` gives the uid and pid that
connected. ``SO_PEERPIDFD`` (Linux 6.5+) gives a pidfd for exactly that process, and on
older kernels ``pidfd_open(pid)`` is taken at accept time. The broker then opens
``/proc/PID/ns/mnt`` and ``/proc/PID/root`` and checks afterwards that the pidfd's process
is still alive. A live pidfd means that the pid was not reused in between, so both fds
belong to the caller. A caller that has exited is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import struct
from dataclasses import dataclass, field

from fuse_plugin.broker import kernel, policy


@dataclass
class Caller:
    pid: int
    uid: int
    gid: int
    pidfd: int
    ns_fd: int = -1
    root_fd: int = -1
    namespace: int = 0  # the mount namespace's inode: one per container
    cgroup: str = ""
    _fds: list[int] = field(default_factory=list)

    def open(self) -> None:
        """Open the caller's mount namespace and root, then prove it is still the same
        process; ``Refused`` if it has gone."""
        try:
            self.ns_fd = self._keep(os.open(f"/proc/{self.pid}/ns/mnt",
                                            os.O_RDONLY | os.O_CLOEXEC))
            self.root_fd = self._keep(os.open(f"/proc/{self.pid}/root",
                                              os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            self.namespace = os.fstat(self.ns_fd).st_ino
            self.cgroup = _cgroup(self.pid)
        except FileNotFoundError:
            raise policy.Refused(f"the calling process {self.pid} has exited") from None
        except PermissionError as err:
            raise policy.Refused(f"cannot enter the caller's namespace: {err.strerror} "
                                 "(the broker needs CAP_SYS_PTRACE and host PID)") from None
        if not self.alive():
            raise policy.Refused(f"the calling process {self.pid} has exited")

    def alive(self) -> bool:
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
        except ProcessLookupError:
            return False
        return True

    def mounts(self) -> list[policy.MountEntry]:
        """The caller's mount table (read from the kernel; never calls a FUSE daemon)."""
        try:
            with open(f"/proc/{self.pid}/mountinfo") as info:
                text = info.read()
        except FileNotFoundError:
            raise policy.Refused(f"the calling process {self.pid} has exited") from None
        if not self.alive():
            raise policy.Refused(f"the calling process {self.pid} has exited")
        return policy.mountinfo(text)

    def resolve(self, path: str) -> int:
        """An O_PATH fd of directory ``path`` in the caller's root: ``..`` cannot leave
        it, and any symlink on the way is refused."""
        try:
            return self._keep(kernel.openat2(
                self.root_fd, path.lstrip("/") or ".",
                os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
                kernel.RESOLVE_IN_ROOT | kernel.RESOLVE_NO_SYMLINKS
                | kernel.RESOLVE_NO_MAGICLINKS))
        except OSError as err:
            reason = {errno.ELOOP: "a symlink is on the way (the shim resolves links; a link here "
                          "means it changed or the client is not the shim)",
                      errno.ENOTDIR: "it is not a directory",
                      errno.ENOENT: "it does not exist",
                      errno.EXDEV: "it leaves the caller's root"}.get(err.errno or 0, err.strerror)
            raise policy.Refused(f"mountpoint {path!r} refused: {reason}") from None

    def close(self) -> None:
        for fd in (self.pidfd, *self._fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self.pidfd = -1

    def _keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd


def identify(conn: socket.socket) -> Caller:
    """The connected process, from the kernel's view of the socket."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    if pid <= 0:
        raise policy.Refused("the caller's pid is not visible (the broker needs host PID)")
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, kernel.SO_PEERPIDFD)
    except OSError as err:
        if err.errno != errno.ENOPROTOOPT:  # ESRCH: the peer has exited
            raise policy.Refused(f"the calling process {pid} has exited") from None
        try:  # before Linux 6.5: the pid, taken as early as possible
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise policy.Refused(f"the calling process {pid} has exited") from None
    os.set_inheritable(pidfd, False)
    return Caller(pid=pid, uid=uid, gid=gid, pidfd=pidfd)


def _cgroup(pid: int) -> str:
    """The caller's cgroup (names the pod and container on a node), for the log line."""
    try:
        with open(f"/proc/{pid}/cgroup") as text:
            lines = text.read().split()
    except OSError:
        return ""
    return next((line.split(":", 2)[2] for line in lines if line.startswith("0::")),
                lines[0] if lines else "")
