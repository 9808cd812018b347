"""The FUSE device node, its health, and the slots the plugin advertises.

/dev/fuse is one shared character device, so a slot is a ticket rather than a piece
of hardware: every slot is healthy exactly when the node is a char device 10:229.
State is one object behind one condition variable with a version counter, so that
ListAndWatch streams sleep until something changes instead of polling.
"""

from __future__ import annotations

import enum
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

FUSE_MAJOR = 10
FUSE_MINOR = 229


class Health(str, enum.Enum):
    # The kubelet compares these strings literally (pluginapi.Healthy / Unhealthy).
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class Probe:
    health: Health
    reason: str


Prober = Callable[[Path], "Probe"]


@dataclass(frozen=True)
class DeviceNode:
    """What stat() says about the path meant to be the FUSE device: the plugin's health
    and the doctor's check both read it from here."""

    problem: str  # "" when it is char 10:229
    missing: bool = False  # no such file (as opposed to unreadable or the wrong kind)
    unreadable: bool = False
    mode: int = 0
    uid: int = 0


def examine(path: Path, shown: Path | None = None) -> DeviceNode:
    """Look at ``path``; messages name ``shown`` (the node's own path, for a doctor that
    reads the node under another root)."""
    name = shown or path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return DeviceNode(f"{name} does not exist", missing=True)
    except OSError as err:
        return DeviceNode(f"{name}: {err.strerror}", unreadable=True)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISCHR(st.st_mode):
        return DeviceNode(f"{name} is not a character device", mode=mode, uid=st.st_uid)
    found = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if found != (FUSE_MAJOR, FUSE_MINOR):
        return DeviceNode(f"{name} is char {found[0]}:{found[1]}, not "
                          f"{FUSE_MAJOR}:{FUSE_MINOR}", mode=mode, uid=st.st_uid)
    return DeviceNode("", mode=mode, uid=st.st_uid)


def probe(path: Path) -> Probe:
    """Healthy exactly while ``path`` is the FUSE character device (10:229)."""
    node = examine(path)
    if node.problem:
        return Probe(Health.UNHEALTHY, node.problem)
    return Probe(Health.HEALTHY, f"{path} is char {FUSE_MAJOR}:{FUSE_MINOR}")


def with_shim(prober: Prober, shim: Path) -> Prober:
    """Broker mode: Allocate binds ``shim`` into every container, and a bind whose source
    is missing makes the runtime create a directory there, which fails that container
    and every later one on the node. So the slots are healthy only while the device is
    and the broker has installed its shim as a regular file."""

    def probe_both(path: Path) -> Probe:
        device = prober(path)
        if device.health is Health.UNHEALTHY:
            return device
        try:
            mode = os.stat(shim).st_mode
        except OSError as err:
            return Probe(Health.UNHEALTHY, f"broker mode: {shim}: {err.strerror} (the "
                                           "broker has not installed its shim on this node)")
        if not stat.S_ISREG(mode):
            return Probe(Health.UNHEALTHY, f"broker mode: {shim} is not a regular file")
        return Probe(Health.HEALTHY, f"{device.reason}; the broker's shim is installed")

    return probe_both


def slot_ids(count: int) -> tuple[str, ...]:
    """Short, stable IDs: the kubelet checkpoints them, so a restart must yield the same."""
    return tuple(f"fuse-{index}" for index in range(count))


class DeviceState:
    """Health of the device node plus a version that moves on every change.

    ``prober`` is injected so that the servicer's and the lifecycle's logic can be tested
    without a real device node (and without root to make one).
    """

    def __init__(self, device: Path, slots: int, prober: Prober = probe) -> None:
        self.device = device
        self.ids = slot_ids(slots)
        # Slot order (fuse-0, fuse-1, ...) for GetPreferredAllocation; also the known set.
        self.order = {device_id: index for index, device_id in enumerate(self.ids)}
        self._prober = prober
        self._cond = threading.Condition()
        self._version = 0
        self._closed = False
        self._probe = prober(device)

    @property
    def health(self) -> Health:
        return self._probe.health

    @property
    def reason(self) -> str:
        return self._probe.reason

    def refresh(self) -> Probe | None:
        """Re-check the node; return the new probe if health changed, else None."""
        result = self._prober(self.device)
        with self._cond:
            if result.health == self._probe.health:
                self._probe = result
                return None
            self._probe = result
            self._version += 1
            self._cond.notify_all()
        return result

    def snapshot(self) -> tuple[int, Health]:
        with self._cond:
            return self._version, self._probe.health

    def wait_for_change(self, seen: int, stop: Callable[[], bool] = lambda: False,
                        timeout: float | None = None) -> tuple[int, Health]:
        """Block until the version moves past ``seen``, the state closes, or ``stop()``.

        ``stop`` is re-checked whenever ``wake`` is called; a closed state returns the
        version unchanged, which tells a stream to end.
        """
        with self._cond:
            self._cond.wait_for(
                lambda: self._version != seen or self._closed or stop(), timeout)
            return (seen if self._closed else self._version), self._probe.health

    def wake(self) -> None:
        """Let every waiter re-check its own stop condition (e.g. a cancelled stream)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def problems(self, ids: Iterable[str]) -> dict[str, list[str]]:
        """Group unusable IDs by why: unknown, duplicate or unhealthy. Empty when all fine."""
        found: dict[str, list[str]] = {}
        seen: set[str] = set()
        healthy = self._probe.health is Health.HEALTHY
        for device_id in ids:
            if device_id not in self.order:
                kind = "unknown"
            elif device_id in seen:
                kind = "duplicate"
            elif not healthy:
                kind = "unhealthy"
            else:
                seen.add(device_id)
                continue
            seen.add(device_id)
            found.setdefault(kind, []).append(device_id)
        return found
