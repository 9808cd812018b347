"""Admission: the mount caps, counted over the mounts the broker holds and those in flight.

``--max-mounts`` (per container), ``--max-mounts-pod`` (per pod, ``policy.pod_of``) and
``--max-mounts-node`` are checked against one count: the records of the mounts the kernel
still holds (``records``) plus a slot for every mount request admitted and not yet ended.
A request takes its slot when it is admitted, before any helper runs (``admit``); the
slot becomes the mount's record when the mount is built and recorded, still detached
(``commit``); however else the request ends (refused, the helper failed or died, past
its deadline, the broker stopping) the slot is given back (``release``).

Why: checked against finished mounts alone, requests that arrived together all passed
the same check. Three containers of one pod asking at once with caps of 2, 4 and 6 ended
with 6, 5 and 5 mounts for the pod's share of 4, and a neighbour pod was refused "the
node already holds 6 FUSE mounts" (issue 34). Slots live in the loop's memory only: a
restarted broker counts its records, since the requests in flight died with the old one.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuse_plugin.broker import policy
from fuse_plugin.broker.records import Record, Records


@dataclass(frozen=True)
class Limits:
    """How many mounts the broker may hold at once: per container, per pod, per node."""

    per_container: int
    per_pod: int
    node: int


@dataclass(eq=False)
class Slot:
    """One admitted mount request's place in the count, until it is a record or ends."""

    container: str
    pod: str


class Admission:
    """The one count of mounts held or in flight, per container, pod and node, and the
    caps on it. Only the broker's loop thread uses it."""

    def __init__(self, records: Records, limits: Limits) -> None:
        self.records = records
        self.limits = limits
        self._slots: set[Slot] = set()
        # The mounts held per container, for the probe thread (``probes``): replaced
        # whole each time the records change, never changed in place.
        self.mounts_held: dict[str, int] = {}

    def admit(self, container: str) -> Slot:
        """A slot for one more mount of ``container``; ``policy.Refused`` ("quota") when
        the container, the node or the container's pod already holds or is making as
        many as its cap."""
        pod = policy.pod_of(container)
        policy.room_for_another(self.container(container), self.limits.per_container,
                                self.node(), self.limits.node)
        policy.room_in_pod(self.pod(pod), self.limits.per_pod, pod)
        slot = Slot(container, pod)
        self._slots.add(slot)
        return slot

    def commit(self, slot: Slot, record: Record) -> None:
        """The mount is built: its record takes the slot's place. ``OSError`` if the
        record cannot be written: then there is no record (no record, no mount) and the
        slot stays until the request ends."""
        assert slot.container == record.container, "a slot becomes its own mount's record"
        try:
            self.records.add(record)
        except OSError:
            self.records.forget(record.connection)
            raise
        self._slots.discard(slot)
        self.mounts_held = self.records.by_container()

    def release(self, slot: Slot | None) -> None:
        """The request has ended: its slot, if it still holds one, counts no more."""
        if slot is not None:
            self._slots.discard(slot)

    def unmounted(self, connection: int) -> None:
        """The broker unmounted this connection's mount: its record counts no more once
        the kernel has let the connection go, which is at once unless something pins
        the mount (an open file: it still counts then, as the kernel still holds it).
        Left to the periodic prune, a pod that unmounted and asks nothing more kept a
        full node refusing its neighbours for up to ``server.PRUNE_EVERY``."""
        self.records.settle(connection)
        self.mounts_held = self.records.by_container()

    def prune(self) -> None:
        """Check every record against the kernel (the loop does so now and then)."""
        self.records.prune()
        self.mounts_held = self.records.by_container()

    def container(self, container: str) -> int:
        """Mounts one container holds or has in flight."""
        return self.records.held(container) + sum(
            1 for s in self._slots if s.container == container)

    def pod(self, pod: str) -> int:
        """Mounts the containers of one pod hold or have in flight."""
        return self.records.held_by_pod(pod) + sum(1 for s in self._slots if s.pod == pod)

    def node(self) -> int:
        """Mounts the node holds (as of the last check of each record) or has in
        flight."""
        return self.records.total + len(self._slots)

    @property
    def in_flight(self) -> int:
        """Slots taken and not yet a record or given back."""
        return len(self._slots)
