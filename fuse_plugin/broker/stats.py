"""What the broker counts, for its metrics; bumped by the loop, read by the probe thread.

The names of its counts over ``fuse_plugin.stats.Counters``, the one implementation the
plugin's ``Stats`` uses too.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuse_plugin.broker import policy
from fuse_plugin.stats import Counters

OPERATIONS = ("mount", "unmount", "lxcfs")  # lxcfs: views bound (lxcfs.py)


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
        # Every operation and refusal kind is listed from the first scrape on, at 0.
        self._counts = Counters([("served", op) for op in OPERATIONS]
                                + [("refused", kind) for kind in policy.kinds()])

    def served(self, op: str) -> None:
        self._counts.add("served", label=op)

    def refused(self, kind: str, count: int = 1) -> None:
        self._counts.add("refused", count, label=kind)

    def failed(self) -> None:
        self._counts.add("failed")

    def stalled(self) -> None:
        self._counts.add("stalled")

    def aborted(self, connections: int) -> None:
        self._counts.add("aborted", connections)

    def accept_paused(self) -> None:
        self._counts.add("accept_pauses")

    def snapshot(self) -> BrokerSnapshot:
        counts = self._counts.snapshot()
        return BrokerSnapshot(counts.by_label("served"), counts.by_label("refused"),
                              counts["failed"], counts["stalled"], counts["aborted"],
                              counts["accept_pauses"])
