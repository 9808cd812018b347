"""What the plugin counts, kept apart from who reads it.

The servicer and the lifecycle are handed one ``Stats`` when they are built and bump it;
the metrics endpoint (or a test) reads a ``snapshot()``. Nothing reaches into another
object's attributes, and a plugin without ``--metrics-port`` pays one lock per event.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

# Allocate costs tens of microseconds in-process; buckets reach up to a slow second.
ALLOCATE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)


@dataclass(frozen=True)
class Snapshot:
    allocations: int
    refusals: int
    registrations: int
    registration_failures: int
    kubelet_restarts: int
    # Per-bucket (not cumulative) counts; the last entry counts what exceeded every bound.
    allocate_buckets: tuple[int, ...]
    allocate_seconds_sum: float


class Stats:
    """Counters bumped from gRPC worker threads and the loop thread; one lock for all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._allocations = 0
        self._refusals = 0
        self._registrations = 0
        self._registration_failures = 0
        self._kubelet_restarts = 0
        self._buckets = [0] * (len(ALLOCATE_BUCKETS) + 1)
        self._seconds = 0.0

    def allocated(self, containers: int, seconds: float) -> None:
        index = bisect.bisect_left(ALLOCATE_BUCKETS, seconds)
        with self._lock:
            self._allocations += containers
            self._buckets[index] += 1
            self._seconds += seconds

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
                            self._registration_failures, self._kubelet_restarts,
                            tuple(self._buckets), self._seconds)
