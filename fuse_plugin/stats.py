"""What the plugin and the broker count, kept apart from who reads it.

``Counters`` is the one implementation: named counts, some split by a label (the
broker's requests by operation), bumped from any thread under one lock and read whole
by ``snapshot()``, so a scrape never sees half of an update. The plugin's ``Stats``
and the broker's ``BrokerStats`` (``fuse_plugin.broker.stats``) only name its counts:
the servicer and the lifecycle, or the broker's loop, are handed one when they are built
and bump it; the metrics endpoint (or a test) reads a snapshot. Nothing reaches into
another object's attributes, and a process without a metrics port pays one lock per
event.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# A count's name and its label's value ("" for a count that has no label).
Key = tuple[str, str]


@dataclass(frozen=True)
class Counts:
    """A copy of every count at one moment; a count never bumped reads 0."""

    values: Mapping[Key, int]

    def __getitem__(self, name: str) -> int:
        return self.values.get((name, ""), 0)

    def by_label(self, name: str) -> dict[str, int]:
        """One labelled count: label value -> count (a name is counted with labels or
        without, never both)."""
        return {label: n for (key, label), n in self.values.items() if key == name}


class Counters:
    """Counts bumped from any thread; one lock for all of them."""

    def __init__(self, zeros: Iterable[Key] = ()) -> None:
        """``zeros``: labelled counts to show as 0 before they are first bumped, so a
        scrape lists every label from the start."""
        self._lock = threading.Lock()
        self._values: dict[Key, int] = dict.fromkeys(zeros, 0)

    def add(self, name: str, amount: int = 1, label: str = "") -> None:
        key = (name, label)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def snapshot(self) -> Counts:
        with self._lock:
            return Counts(dict(self._values))


@dataclass(frozen=True)
class Snapshot:
    allocations: int
    refusals: int
    registrations: int
    registration_failures: int
    kubelet_restarts: int


class Stats:
    """The plugin's counts, bumped from gRPC worker threads and the loop thread."""

    def __init__(self) -> None:
        self._counts = Counters()

    def allocated(self, containers: int) -> None:
        self._counts.add("allocations", containers)

    def refused(self) -> None:
        self._counts.add("refusals")

    def registered(self) -> None:
        self._counts.add("registrations")

    def registration_failed(self) -> None:
        self._counts.add("registration_failures")

    def kubelet_restarted(self) -> None:
        self._counts.add("kubelet_restarts")

    def snapshot(self) -> Snapshot:
        counts = self._counts.snapshot()
        return Snapshot(counts["allocations"], counts["refusals"], counts["registrations"],
                        counts["registration_failures"], counts["kubelet_restarts"])
