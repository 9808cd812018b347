"""One request's helper process (``native/helper.c``), seen from the broker's loop.

The helper does every step that touches the caller's objects: it takes the caller's
/dev/fuse fd, enters the caller's namespaces, resolves the path, reports the facts, and
after the broker's verdict mounts or unmounts. The loop never waits for it: it talks to
it over a non-blocking ``SOCK_SEQPACKET`` pair and learns that it exited from its pidfd,
both in the loop's selector. A helper past its deadline is killed; one that does not die
(a process stuck in the kernel on a tenant's FUSE daemon) is left to the loop, which may
abort that tenant's FUSE connections to free it.

Spawning a small static program costs a fraction of a millisecond (vfork + exec); a
fork of the Python broker would cost more and would not be single-threaded, which
``setns`` into a mount namespace requires.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin.broker import cgroups, frames, messages, protocol
from fuse_plugin.broker.caller import Caller

NAME = "fuse-broker-helper"


@dataclass
class Job:
    """A running helper and the request it serves."""

    proc: subprocess.Popen[bytes]
    ctl: socket.socket
    pidfd: int
    deadline: float
    killed_at: float | None = None
    aborted: bool = False

    @classmethod
    def start(cls, program: Path, caller: Caller, request: protocol.Request,
              deadline: float, charge: Sequence[tuple[str, int]] = ()) -> Job:
        """Spawn the helper for ``request`` and send it. ``frames.FrameError`` if the
        request cannot be said whole (refused, never cut); ``OSError`` if it cannot run,
        with nothing left behind (no process, no descriptor). ``charge``: the caller's
        cgroup.procs files (``cgroups.Charge.open``), which the helper moves itself into
        first; the caller of this closes them."""
        message = messages.encode(messages.Request(
            op=request.op, path=request.path, uid=caller.uid, gid=caller.gid,
            groups=tuple(caller.groups),
            fuse_fd=request.fuse_fd if request.op == "mount" else None))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc: subprocess.Popen[bytes] | None = None
        try:
            fds = [theirs.fileno(), caller.pidfd, caller.mnt_ns]
            if caller.user_ns != -1:
                fds.append(caller.user_ns)
            proc = subprocess.Popen([str(program), *map(str, fds)],
                                    pass_fds=[*fds, *(fd for _, fd in charge)],
                                    env=cgroups.environment(charge) if charge else {},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            theirs.close()
            pidfd = os.pidfd_open(proc.pid)  # not reaped yet, so it is this process
        except BaseException:
            ours.close()
            theirs.close()
            if proc is not None:  # started, but the loop could not watch it: gone now
                proc.kill()
                proc.wait()
            raise
        ours.setblocking(False)
        job = cls(proc, ours, pidfd, deadline)
        try:
            # A datagram is sent whole or not at all; the buffer is sized for the
            # largest frame (the kernel caps it at net.core.wmem_max: EMSGSIZE then).
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, frames.MAX_FRAME)
            ours.send(message)
        except OSError:
            job.kill()
            proc.wait()
            job.close()
            raise
        return job

    def send(self, answer: messages.Answer) -> None:
        """An answer to the helper (go, the verdict)."""
        message = messages.encode(answer)
        with contextlib.suppress(OSError):  # a helper that died is seen on its pidfd
            self.ctl.send(message)

    def receive(self) -> messages.Heard | None:
        """The helper's next report, or that it closed its end (``Exited``) or sent no
        frame (``Nonsense``); None when it has nothing to say now."""
        try:
            data = self.ctl.recv(frames.MAX_FRAME + 1)
        except BlockingIOError:
            return None
        except OSError:
            data = b""
        if not data:
            return messages.Exited()
        try:
            return frames.decode(data, frames.REPORT)
        except frames.FrameError as bad:
            return messages.Nonsense(str(bad))

    def kill(self) -> None:
        """SIGKILL at the deadline; the loop keeps the job until its pidfd says it died."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def close(self) -> None:
        self.ctl.close()
        os.close(self.pidfd)
        self.proc.poll()
