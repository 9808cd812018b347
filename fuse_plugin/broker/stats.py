"""What the broker counts, for its metrics; bumped by the loop, read by the probe thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from fuse_plugin.broker import policy


@dataclass(frozen=True)
class BrokerSnapshot:
    served: dict[str, int]
    refused: dict[str, int]
    failed: int
    stalled: int
    aborted: int
    accept_pauses: int


class BrokerStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served = {"mount": 0, "unmount": 0}
        self._refused = dict.fromkeys(policy.kinds(), 0)
        self._failed = self._stalled = self._aborted = self._pauses = 0

    def served(self, op: str) -> None:
        with self._lock:
            self._served[op] = self._served.get(op, 0) + 1

    def refused(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self._refused[kind] = self._refused.get(kind, 0) + count

    def failed(self) -> None:
        with self._lock:
            self._failed += 1

    def stalled(self) -> None:
        with self._lock:
            self._stalled += 1

    def aborted(self, connections: int) -> None:
        with self._lock:
            self._aborted += connections

    def accept_paused(self) -> None:
        with self._lock:
            self._pauses += 1

    def snapshot(self) -> BrokerSnapshot:
        with self._lock:
            return BrokerSnapshot(dict(self._served), dict(self._refused), self._failed,
                                  self._stalled, self._aborted, self._pauses)
