"""Making and removing a caller's FUSE mount without running anything in its root.

Mount: real ``fusermount3`` mounts on a staging directory in the broker's own private
mount namespace. Its binary, loader, libraries, ``/etc/mtab`` and ``/bin/mount`` are
all the broker's, never the container's (docs/broker.md says why that matters). The mount
is cloned detached with ``open_tree``, the staging mount is dropped, ``nosuid,nodev`` and
private propagation are forced on the clone, and ``fuse-broker-enter`` (static C,
native/enter.c) ``setns``es into the caller's mount namespace and ``move_mount``s the
clone onto the directory fd that was resolved in the caller's root. Unmount: the same
helper enters the namespace and calls ``umount2`` on the name inside the resolved parent.

The namespace step is a separate small program, not a fork of the broker: ``setns`` into a
mount namespace needs a single-threaded process, the broker's own namespace is never
changed, and exec'ing a static binary takes a tenth of the time of forking Python.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

from fuse_plugin.broker import kernel

SAFE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
STAGING_OPTIONS = "mode=0700,size=1m"


class MountFailed(Exception):
    """fusermount3 or the kernel said no; the message is one line for the caller."""


class Mounter:
    def __init__(self, fusermount: Path, enter: Path, staging: Path,
                 timeout: float = 10.0) -> None:
        self.fusermount = fusermount
        self.enter = enter
        self.staging = staging
        self.timeout = timeout
        self._count = 0
        self._stragglers: list[subprocess.Popen[str]] = []

    def prepare(self) -> None:
        """Give the broker a private mount namespace with a tmpfs for staging, so that no
        staging mount is ever seen (or propagated) outside it, and all of them vanish
        with the broker if it is killed. Must run before the process has threads."""
        kernel.unshare(kernel.CLONE_NEWNS)
        kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
        self.staging.mkdir(parents=True, exist_ok=True)
        kernel.mount("fuse-broker-staging", str(self.staging), "tmpfs",
                     kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC, STAGING_OPTIONS)

    def mount(self, ns_fd: int, target_fd: int, options: str) -> tuple[int, int]:
        """Mount FUSE on ``target_fd`` in namespace ``ns_fd``: (the /dev/fuse fd, the new
        mount's id)."""
        self._count += 1
        stage = self.staging / f"m{self._count}"
        stage.mkdir(mode=0o700)
        fuse_fd = tree = -1
        try:
            fuse_fd = self._fusermount(stage, options)
            tree = kernel.open_tree_clone(str(stage))
            kernel.umount2(str(stage), kernel.MNT_DETACH)
            kernel.force_nosuid_nodev_private(tree)
            mount_id = kernel.fd_mount_id(tree)
            self._enter("attach", ns_fd, tree, target_fd)
        except BaseException:
            if fuse_fd != -1:
                os.close(fuse_fd)
            raise
        finally:
            # Not mounted any more (or never): EINVAL is the usual answer here.
            with contextlib.suppress(OSError):
                kernel.umount2(str(stage), kernel.MNT_DETACH)
            if tree != -1:
                os.close(tree)
            with contextlib.suppress(OSError):
                stage.rmdir()
        return fuse_fd, mount_id

    def unmount(self, ns_fd: int, parent_fd: int, name: str, lazy: bool) -> None:
        self._enter("unmount", ns_fd, parent_fd, name=name, lazy=lazy)

    def _enter(self, op: str, *fds: int, name: str = "", lazy: bool = False) -> None:
        """Run fuse-broker-enter with ``fds``; ``MountFailed`` with its one line."""
        args = [str(self.enter), op, *map(str, fds), *([name] if name else []),
                *(["lazy"] if lazy else [])]
        self._run(args, f"the {op} step in the caller's namespace", fds, {})

    def _fusermount(self, stage: Path, options: str) -> int:
        """Run real fusermount3 with its own _FUSE_COMMFD socketpair; the fd it sends."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            self._run([str(self.fusermount), "-o", options, "--", str(stage)], "fusermount3",
                      (theirs.fileno(),),
                      {"_FUSE_COMMFD": str(theirs.fileno()), "PATH": SAFE_PATH})
            theirs.close()
            ours.settimeout(self.timeout)
            _, fds, _, _ = socket.recv_fds(ours, 1, 4)
        for extra in fds[1:]:
            os.close(extra)
        if not fds:
            raise MountFailed("fusermount3 sent no file descriptor")
        return fds[0]

    def _run(self, args: list[str], what: str, fds: tuple[int, ...],
             env: dict[str, str]) -> None:
        """Run a helper to its end or its deadline; ``MountFailed`` with its last line.

        At the deadline it is SIGKILLed and left to ``reap``, not waited for: a process
        stuck on a container's FUSE daemon (an unmount flushing to a daemon that never
        answers) may not die until that daemon's connection goes, and the broker must not
        wait with it."""
        proc = subprocess.Popen(args, pass_fds=fds, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            if proc.stderr is not None:
                proc.stderr.close()
            self._stragglers.append(proc)
            raise MountFailed(f"{what} did not finish within {self.timeout}s") from None
        if proc.returncode != 0:
            said = err.strip().splitlines()
            raise MountFailed(said[-1] if said else f"{what} exited {proc.returncode}")

    def reap(self) -> int:
        """Collect helpers killed at their deadline that have died since; how many remain."""
        self._stragglers = [p for p in self._stragglers if p.poll() is None]
        return len(self._stragglers)
