"""What the plugin counts, kept apart from who reads it.

The servicer and the lifecycle are handed one ``Stats`` when they are built and bump it;
the metrics endpoint (or a test) reads a ``snapshot()``. Nothing reaches into another
object's attributes, and a plugin without ``--metrics-port`` pays one lock per event.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    allocations: int
    refusals: int
    registrations: int
    registration_failures: int
    kubelet_restarts: int


class Stats:
    """Counters bumped from gRPC worker threads and the loop thread; one lock for all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocations = 0
        self._refusals = 0
        self._registrations = 0
        self._registration_failures = 0
        self._kubelet_restarts = 0

    def allocated(self, containers: int) -> None:
        with self._lock:
            self._allocations += containers

    def refused(self) -> None:
        with self._lock:
            self._refusals += 1

    def registered(self) -> None:
        with self._lock:
            self._registrations += 1

    def registration_failed(self) -> None:
        with self._lock:
            self._registration_failures += 1

    def kubelet_restarted(self) -> None:
        with self._lock:
            self._kubelet_restarts += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self._allocations, self._refusals, self._registrations,
                            self._registration_failures, self._kubelet_restarts)
