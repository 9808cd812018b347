"""What the broker mounted, for whom: kept on the node so that a restarted broker knows.

One small file per mount, named after the FUSE connection the mount created and that
connection's directory inode in fusectl (``/sys/fs/fuse/connections/N``). The kernel
keeps that directory exactly as long as the connection's superblock lives, which is as
long as anything holds the mount: lazily unmounted and hidden mounts included. So
counting a container's live records counts what the kernel holds for it, and a record
whose directory is gone (or is now another connection's: numbers are reused, inodes are
not) is dropped. The directory lives in the node's ``/run`` (a tmpfs): records go with
a reboot, as connections do.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from fuse_plugin import files
from fuse_plugin.broker.policy import Owner, pod_of

FUSECTL = Path("/sys/fs/fuse/connections")


def abort(connection: int, fusectl: Path = FUSECTL) -> bool:
    """Abort one FUSE connection: every request on it fails at once, so whatever waits
    on its daemon (a helper, a container's process) is freed. False if it has gone
    already. The broker frees a stuck helper with it, the demo a container past its
    deadline."""
    try:
        (fusectl / str(connection) / "abort").write_text("1")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Record:
    connection: int
    ctl_inode: int  # of fusectl's directory for the connection: tells reuse apart
    container: str
    uid: int
    namespace: int
    mount_id: int
    path: str

    @property
    def name(self) -> str:
        return f"{self.connection}-{self.ctl_inode}.json"

    @property
    def owner(self) -> Owner:
        return Owner(self.container, self.uid)


class Records:
    """The broker's records, in memory and in ``directory``; only the broker's loop
    thread uses them."""

    def __init__(self, directory: Path, fusectl: Path = FUSECTL) -> None:
        self.directory = directory
        self.fusectl = fusectl
        self._records: dict[int, Record] = {}

    def load(self) -> int:
        """Read what an earlier broker left; drop what the kernel no longer holds.
        Returns how many are live."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        for entry in self.directory.glob("*.json"):
            if entry.name.startswith("."):  # a write a killed broker never renamed
                entry.unlink(missing_ok=True)
                continue
            try:
                record = Record(**json.loads(files.read_regular(entry)))
            except (OSError, ValueError, TypeError, files.NotReadable):
                entry.unlink(missing_ok=True)
                continue
            self._records[record.connection] = record
        self.prune()
        return len(self._records)

    def inode_of(self, connection: int) -> int | None:
        try:
            return os.stat(self.fusectl / str(connection)).st_ino
        except FileNotFoundError:
            return None

    def add(self, record: Record) -> None:
        """Written before anything is dropped: a broker killed at any instant in here
        leaves the new record or no change (an earlier connection of the same number,
        gone from the kernel, is forgotten only once the new one is on disk)."""
        # Renamed into place, not fsynced: a record must survive the broker, not the
        # node (a reboot ends every connection), and a mount should not wait on a disk.
        temp = self.directory / f".{record.name}"
        temp.write_text(json.dumps(asdict(record)))
        os.replace(temp, self.directory / record.name)
        old = self._records.get(record.connection)
        if old is not None and old.name != record.name:
            self._forget(old)
        self._records[record.connection] = record

    def forget(self, connection: int) -> None:
        """Drop a record (one whose file could not be written)."""
        record = self._records.get(connection)
        if record is not None:
            self._forget(record)

    def owner(self, connection: int) -> Owner | None:
        """Whom the live connection's mount was made for, if the broker made it."""
        record = self._records.get(connection)
        if record is None or self.inode_of(connection) != record.ctl_inode:
            return None
        return record.owner

    def held(self, container: str) -> int:
        """Live mounts the broker made for one container (its records are checked
        against the kernel now)."""
        self.prune(container)
        return sum(1 for r in self._records.values() if r.container == container)

    def held_by_pod(self, pod: str) -> int:
        """Live mounts the broker made for the containers of one pod."""
        mine = [r for r in self._records.values() if pod_of(r.container) == pod]
        for record in mine:
            if self.inode_of(record.connection) != record.ctl_inode:
                self._forget(record)
        return sum(1 for r in self._records.values() if pod_of(r.container) == pod)

    @property
    def total(self) -> int:
        """Mounts the broker made for the node, as of the last prune of each."""
        return len(self._records)

    def connections(self, container: str) -> list[int]:
        return [r.connection for r in self._records.values() if r.container == container]

    def by_container(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self._records.values():
            counts[record.container] = counts.get(record.container, 0) + 1
        return counts

    def settle(self, connection: int) -> None:
        """Drop one connection's record if the kernel no longer holds it (after the
        broker unmounted it: the count falls now, not at the next prune)."""
        record = self._records.get(connection)
        if record is not None and self.inode_of(connection) != record.ctl_inode:
            self._forget(record)

    def prune(self, container: str | None = None) -> None:
        for record in list(self._records.values()):
            if container is not None and record.container != container:
                continue
            if self.inode_of(record.connection) != record.ctl_inode:
                self._forget(record)

    def _forget(self, record: Record) -> None:
        self._records.pop(record.connection, None)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / record.name).unlink()
