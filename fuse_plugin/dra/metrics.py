"""The DRA driver's metrics, beside its probes on the one port (``--probe-port``).

What an operator asks of a DRA driver: are claims being prepared, how long does it take,
what fails, how many claims does the node hold, is the slice being written. The servicer
bumps ``DraStats`` per claim (counts and a latency histogram by outcome); the loop's
state (registered, device health, slice writes, claims on disk) is read at scrape time.
``fuse_plugin.exposition`` writes the text, as it does the plugin's and the broker's.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass

from fuse_plugin.exposition import Exposition, Sample, Series

PREFIX = "fuse_dra"
# Seconds. A recorded claim answers in well under a millisecond, one read from the API
# server in milliseconds, a slow API server in seconds.
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Outcomes per claim: answered from the record, prepared anew, refused with a message,
# an error of ours; unprepared, or failed.
PREPARE_OUTCOMES = ("recorded", "prepared", "refused", "error")
UNPREPARE_OUTCOMES = ("unprepared", "failed")


@dataclass
class _Histogram:
    counts: list[int]
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds


class DraStats:
    """Per-claim outcomes and latencies, bumped from the gRPC workers under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slices = 0
        self._hist = {(op, outcome): _Histogram([0] * (len(BUCKETS) + 1))
                      for op, outcomes in (("prepare", PREPARE_OUTCOMES),
                                           ("unprepare", UNPREPARE_OUTCOMES))
                      for outcome in outcomes}

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        with self._lock:
            self._hist[(op, outcome)].observe(seconds)

    def samples(self, op: str) -> tuple[list[Sample], list[Series]]:
        """The ``<op>_claims_total`` samples and the ``<op>_seconds`` series, by outcome."""
        totals: list[Sample] = []
        series: list[Series] = []
        with self._lock:
            for (name, outcome), h in self._hist.items():
                if name != op:
                    continue
                totals.append(({"outcome": outcome}, sum(h.counts)))
                cumulative = list(itertools.accumulate(h.counts))
                series.append(({"outcome": outcome},
                               list(zip((*map(str, BUCKETS), "+Inf"), cumulative,
                                        strict=True)), h.total))
        return totals, series


@dataclass(frozen=True)
class State:
    """What the loop holds at scrape time."""

    registered: bool
    device_healthy: bool
    claims_prepared: int
    slice_writes: int
    slice_failures: int


def exposition(stats: DraStats, state: State) -> bytes:
    out = Exposition(PREFIX)
    out.family("registered", "gauge", "1 when the kubelet has accepted our registration",
               ({}, int(state.registered)))
    out.family("device_healthy", "gauge", "1 when /dev/fuse is the FUSE device",
               ({}, int(state.device_healthy)))
    out.family("claims_prepared", "gauge", "Claims with a CDI spec on this node",
               ({}, state.claims_prepared))
    out.family("slice_writes_total", "counter",
               "ResourceSlice creations and updates this driver made",
               ({}, state.slice_writes))
    out.family("slice_sync_failures_total", "counter",
               "ResourceSlice checks that failed (retried)", ({}, state.slice_failures))
    for op, text in (("prepare", "NodePrepareResources claims by outcome"),
                     ("unprepare", "NodeUnprepareResources claims by outcome")):
        totals, series = stats.samples(op)
        out.family(f"{op}_claims_total", "counter", text, *totals)
        out.histogram(f"{op}_seconds", f"Seconds to answer one claim's {op}", *series)
    return out.encode()
