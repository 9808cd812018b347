"""The broker's records of LXCFS views' consumers, kept across its own restarts.

A consumer is the process that asked (``fusermount3 --lxcfs -- CMD`` became CMD) and its
mount namespace. The broker holds a pidfd and the namespace while it runs; a record in
its state directory (a tmpfs in the node's /run, like the mounts' records) lets the
next broker find the same consumers after a rollout, so the next lxcfs restart still
heals them. A record names the process by pid, start time, cgroup and mount namespace;
one whose process is gone or whose pid now names another process is dropped at load.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import files


@dataclass(eq=False)
class Consumer:
    """A process that asked for the views, and its mount namespace, held until it
    exits (its pidfd says when)."""

    container: str
    pid: int
    pidfd: int
    mnt_ns: int

    def close(self) -> None:
        for fd in (self.pidfd, self.mnt_ns):
            with contextlib.suppress(OSError):
                os.close(fd)


def _identity(pid: int) -> dict[str, int]:
    """What names the process beyond its pid: its start time (field 22 of its stat,
    after the parenthesised name) and its mount namespace."""
    with open(f"/proc/{pid}/stat") as text:
        start = int(text.read().rpartition(")")[2].split()[19])
    return {"pid": pid, "start": start, "namespace": os.stat(f"/proc/{pid}/ns/mnt").st_ino}


class ConsumerRecords:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def save(self, consumer: Consumer) -> None:
        """Best effort: a consumer the broker cannot record is still served now."""
        with contextlib.suppress(OSError):
            self.directory.mkdir(parents=True, exist_ok=True)
            files.write_atomic(self.directory / f"{consumer.pid}.json",
                               json.dumps({**_identity(consumer.pid),
                                           "container": consumer.container}).encode(), 0o600)

    def forget(self, consumer: Consumer) -> None:
        with contextlib.suppress(OSError):
            (self.directory / f"{consumer.pid}.json").unlink()

    def load(self) -> list[Consumer]:
        """The recorded consumers still alive as recorded; the rest are removed."""
        found = []
        for entry in sorted(self.directory.glob("*.json")):
            consumer = self._reopen(entry)
            if consumer is None:
                with contextlib.suppress(OSError):
                    entry.unlink()
            else:
                found.append(consumer)
        return found

    @staticmethod
    def _reopen(entry: Path) -> Consumer | None:
        pidfd = -1
        try:
            recorded = json.loads(files.read_regular(entry))
            pid = int(recorded["pid"])
            pidfd = os.pidfd_open(pid)
            mnt_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError, KeyError, TypeError):
            if pidfd != -1:
                os.close(pidfd)
            return None
        consumer = Consumer(str(recorded["container"]), pid, pidfd, mnt_ns)
        try:
            same = {**_identity(pid), "container": consumer.container} == recorded \
                and os.fstat(mnt_ns).st_ino == recorded["namespace"]
        except OSError:
            same = False
        if not same:
            consumer.close()
            return None
        return consumer
