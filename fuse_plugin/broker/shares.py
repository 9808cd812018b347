"""Shares that hold on a full node: each node-wide cap is a pod's share times the pods
the node may run.

A pod (``policy.pod_of``) gets a share of everything the broker holds for tenants: open
requests (connections accepted and not yet answered: ``PER_CONTAINER`` a container,
``PER_POD`` a pod), live helpers (``PER_POD_HELPERS``; its further requests wait for its
own) and mounts (``--max-mounts-pod``). The node-wide caps used to be fixed numbers
(256 requests, 64 helpers, 1,000 mounts), so pods each within their share still filled
one together: one tenant's 64 single-container pods holding 4 silent connections each
took all 256 requests, and a neighbour was answered "the broker is busy" (issue 34).

The kubelet runs at most maxPods pods on a node (110 by default), so here every node-wide
cap is the per-pod share times ``--max-pods`` (``NodeCaps.for_pods``): while the node runs
no more pods than that, the caps are never reached by pods that keep to their shares,
and a pod within its own share is never refused, nor made to wait, by a node-wide cap,
whatever the other pods do. What the caps still bound is the broker's own cost, which
is sized from them: its descriptors (``NodeCaps.descriptors``, the soft limit is raised
to match at start) and its memory (the DaemonSet's limit, measured in bench/). A node
can give the guarantee up: more pods than --max-pods, an explicit ``--max-mounts-node``
below the product (``NodeCaps.short``), a hard fd limit below what the caps need; the
broker says so when it starts, of the last two (``server.Broker._say_short``).
"""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import dataclass

from fuse_plugin.broker import policy

# A pod's shares (the mounts' are flags: --max-mounts, --max-mounts-pod).
PER_CONTAINER = 4  # open requests of one container: silent connections take its own
PER_POD = 16  # open requests of all the containers of one pod together
# Helpers alive for one pod: a container has one at a time, and a pod's requests beyond
# this wait for its own. What each helper costs the broker's pod (more for a caller of
# 32,768 groups) is in bench/README.md, the broker at its caps: the node's 2 x --max-pods
# is what the DaemonSet's memory limit covers (8 a pod would need four times as much).
PER_POD_HELPERS = 2
DEFAULT_MAX_PODS = 110  # the kubelet's default maxPods

# Descriptors the broker holds: for an open request its connection, the caller's pidfd
# and, once its request is read, the caller's mount and user namespaces; for a helper
# its control socket and pidfd. Beside them: the listener, the wake-up pair, the
# selector, the probe port's connections (64 at most) and what a step opens and closes
# at once (a helper's start, a record's write).
FDS_PER_REQUEST = 4
FDS_PER_HELPER = 2
FDS_BESIDE = 128


@dataclass(frozen=True)
class NodeCaps:
    """The node-wide caps for a node of ``max_pods`` pods."""

    max_pods: int
    requests: int  # open requests
    helpers: int  # helpers alive, killed ones not yet exited included
    mounts: int  # --max-mounts-node
    mounts_pod: int  # --max-mounts-pod

    @classmethod
    def for_pods(cls, max_pods: int, mounts_pod: int, mounts: int | None = None) -> NodeCaps:
        """Each cap a pod's share times ``max_pods``; ``mounts`` (an explicit
        --max-mounts-node) replaces the product for mounts."""
        return cls(max_pods=max_pods, requests=PER_POD * max_pods,
                   helpers=PER_POD_HELPERS * max_pods,
                   mounts=mounts_pod * max_pods if mounts is None else mounts,
                   mounts_pod=mounts_pod)

    @property
    def short(self) -> list[str]:
        """The caps that ``max_pods`` pods at their share could fill (only an explicit
        --max-mounts-node can be): there, one tenant's pods can refuse another's."""
        needed = self.mounts_pod * self.max_pods
        if self.mounts >= needed:
            return []
        return [f"--max-mounts-node {self.mounts} is less than --max-mounts-pod "
                f"{self.mounts_pod} x --max-pods {self.max_pods} = {needed}: "
                f"{self.mounts // self.mounts_pod} pods at their share fill it"]

    @property
    def descriptors(self) -> int:
        """The descriptors the broker may hold at these caps."""
        return (FDS_PER_REQUEST * self.requests + FDS_PER_HELPER * self.helpers
                + FDS_BESIDE)

    def pods_within(self, descriptors: int) -> int:
        """How many pods at their share ``descriptors`` descriptors serve."""
        per_pod = FDS_PER_REQUEST * PER_POD + FDS_PER_HELPER * PER_POD_HELPERS
        return max(0, descriptors - FDS_BESIDE) // per_pod


def raise_fd_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``needed``, as far as the hard limit allows
    (no privilege needed: containerd 2 under systemd leaves containers at a soft 1,024
    under a hard 524,288), never lowering it; returns the soft limit now in force. Why: short of
    descriptors the loop answers "busy" and pauses (``server.Broker._survive``), which
    is what a flood's neighbours would get. (Linux never has an infinite RLIMIT_NOFILE:
    fs.nr_open bounds it.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(needed, hard)
    if wanted <= soft:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return wanted


@dataclass(eq=False)
class Ticket:
    """One open request's place in the count, from accept to its answer."""

    container: str
    pod: str


class OpenRequests:
    """Open requests per container, per pod and on the node, counted as they come and go
    (a flood is refused at accept in constant time, however many are open), and the
    shares on them. Only the broker's loop thread uses it."""

    def __init__(self, caps: NodeCaps) -> None:
        self.caps = caps
        self._containers: Counter[str] = Counter()
        self._pods: Counter[str] = Counter()
        self._tickets: set[Ticket] = set()

    def admit(self, container: str) -> Ticket:
        """A place for one more request of ``container``; ``policy.Refused`` ("busy")
        past its container's share, its pod's, or (on a node with more pods than
        --max-pods) the node's."""
        mine = self._containers[container]
        if mine >= PER_CONTAINER:
            raise policy.Refused(f"this container has {mine} requests open, the most it "
                                 "may; try again", "busy")
        pod = policy.pod_of(container)
        ours = self._pods[pod]
        if ours >= PER_POD:
            raise policy.Refused(f"this pod has {ours} requests open, its share of the "
                                 "node's; try again", "busy")
        if len(self._tickets) >= self.caps.requests:
            raise policy.Refused(
                f"the broker is busy ({len(self._tickets)} requests open, {PER_POD} for "
                f"each of --max-pods {self.caps.max_pods} pods); try again", "busy")
        ticket = Ticket(container, pod)
        self._tickets.add(ticket)
        self._containers[container] += 1
        self._pods[pod] += 1
        return ticket

    def release(self, ticket: Ticket | None) -> None:
        """The request has been answered or dropped: its place is free (once)."""
        if ticket is None or ticket not in self._tickets:
            return
        self._tickets.discard(ticket)
        for counts, key in ((self._containers, ticket.container), (self._pods, ticket.pod)):
            counts[key] -= 1
            if not counts[key]:
                del counts[key]

    def __len__(self) -> int:
        return len(self._tickets)
