"""The helper scheduler: which request's helper runs when, and what happens to a helper
that will not go.

A request the loop has admitted (``Conversation.prepare``) waits in its container's
queue. A container has one helper alive at a time, a killed one that has not exited
included (it still holds what it took), and a pod at most ``shares.PER_POD_HELPERS``:
its further requests wait for its own helpers (``_wake_pod``), which end within
HELPER_DEADLINE; the node's cap (``NodeCaps.helpers``) is only reached by more pods than
--max-pods. A helper past its deadline is failed and killed; a released helper stays
counted among the exiting until its pidfd says it has gone; one still alive KILL_GRACE
after its SIGKILL is blocked in the kernel on one of the container's FUSE daemons, so
the connections the broker made for that container are aborted, and the container's
waiting requests are answered "busy" meanwhile.

The loop (``server.Broker``) owns the sockets and the answers: the scheduler tells it
through ``Answers`` which request to refuse or fail, and registers the helpers'
descriptors in the loop's selector.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin import logs
from fuse_plugin.broker import cgroups, events, frames, policy, records, shares
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.helper import NAME as HELPER_NAME
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.reports import HelperFailed
from fuse_plugin.broker.stats import BrokerStats

HELPER_DEADLINE = 5.0  # seconds a helper may take; then it is killed
KILL_GRACE = 2.0  # a killed helper still alive after this is stuck on a FUSE daemon


@dataclass(eq=False)
class Exiting:
    """A released helper, killed, until its pidfd says it has exited (one still alive
    KILL_GRACE after its SIGKILL is stuck: ``Scheduler._reap_stuck``)."""

    container: str
    job: Job


@dataclass(frozen=True)
class Answers:
    """How the loop answers what the scheduler decides: a refusal, a failure, and a
    pause of accepting when the broker itself is short of descriptors or memory."""

    refuse: Callable[[Conversation, policy.Refused], None]
    fail: Callable[[Conversation, HelperFailed], None]
    pause: Callable[[OSError], None]


class Scheduler:
    """Per-container queues, the helpers at work and those exiting. Only the broker's
    loop thread uses it."""

    def __init__(self, selector: selectors.BaseSelector, caps: shares.NodeCaps, *,
                 helper_binary: Path, store: records.Records, stats: BrokerStats,
                 log: logging.Logger, answers: Answers) -> None:
        self.selector = selector
        self.caps = caps
        self.helper_binary = helper_binary
        self.records = store
        self.stats = stats
        self.log = log
        self.answers = answers
        self.charge = cgroups.Charge(())  # where helpers run: their callers' cgroups
        self.queued: dict[str, collections.deque[Conversation]] = {}  # by container
        self.running: dict[str, Conversation] = {}  # by container: its helper is at work
        self.exiting: list[Exiting] = []  # released (killed) helpers not exited yet

    @property
    def holding(self) -> bool:
        """Requests queued or with a helper at work (what the drain waits for)."""
        return bool(self.queued or self.running)

    def is_running(self, conversation: Conversation) -> bool:
        """Whether this request's helper is the one at work for its container (an event
        for a helper released earlier in the turn is not)."""
        return self.running.get(conversation.container) is conversation

    def queue(self, conversation: Conversation) -> None:
        """An admitted request waits for its container's helper (it may start now)."""
        conversation.advance(State.QUEUED)
        self.queued.setdefault(conversation.container,
                               collections.deque()).append(conversation)
        self.next(conversation.container)

    def withdraw(self, conversation: Conversation) -> None:
        """The request leaves its queue, if it is in one (a shortage interrupted it)."""
        for queue in self.queued.values():
            if conversation in queue:
                queue.remove(conversation)

    def take_queued(self) -> list[Conversation]:
        """Every queued request, out of the queues (the drain refuses them)."""
        queued = [w for q in self.queued.values() for w in q]
        self.queued.clear()
        return queued

    def soonest(self) -> list[float]:
        """The deadline of the helper that started first, if any: the table is kept in
        the order deadlines fall (see ``server.Broker._soonest``)."""
        first = next(iter(self.running.values()), None)
        return [first.job.deadline] if first is not None and first.job is not None else []

    def next(self, container: str) -> None:
        """Start the container's next request once none of its helpers is alive (a
        killed one that has not exited included: it still holds what it took) and its
        pod has fewer than its share alive; until then the request waits in its queue,
        for helpers of its own pod only (``_wake_pod``), which end within their
        deadline."""
        queue = self.queued.get(container)
        refuse, fail, pause = self.answers.refuse, self.answers.fail, self.answers.pause
        while queue and not self._helper_alive(container) and self._pod_has_room(container):
            conversation = queue.popleft()
            refused = self._helpers_full()
            if refused is not None:
                refuse(conversation, refused)
                continue
            try:
                conversation.job = self._spawn(conversation)
            except policy.Refused as uncharged:
                if isinstance(uncharged, policy.OutOfResources):
                    pause(uncharged.error)
                refuse(conversation, uncharged)
                continue
            except frames.FrameError as err:
                refuse(conversation, policy.Refused(
                    f"the request cannot be handed to the helper whole ({err}); it is "
                    "refused rather than cut", "request"))
                continue
            except OSError as err:
                if policy.out_of_resources(err):
                    pause(err)
                    refuse(conversation, policy.OutOfResources(f"starting {HELPER_NAME}", err))
                else:
                    fail(conversation, HelperFailed(f"cannot start {HELPER_NAME}: "
                                                    f"{err.strerror or err}"))
                continue
            conversation.advance(State.RUNNING)
            self.running[container] = conversation
            job = conversation.job
            self.selector.register(job.ctl, selectors.EVENT_READ, events.FromHelper(conversation))
            self.selector.register(job.pidfd, selectors.EVENT_READ,
                                   events.HelperExited(conversation))
        if queue and self._blocked(container, time.monotonic()):
            blocked = policy.Refused(
                "this container's last helper is blocked in the kernel (on a FUSE "
                "daemon) and has not exited; try again", "busy")
            while queue:
                refuse(queue.popleft(), blocked)
        if queue is not None and not queue:
            del self.queued[container]

    def _spawn(self, conversation: Conversation) -> Job:
        """The request's helper, in its caller's cgroups (``cgroups``): ``Refused`` if
        they cannot be opened or the caller has gone meanwhile."""
        charge = self.charge.open(conversation.caller.pid)
        try:
            # The cgroups were its pid's, not a reuser's:
            if charge and not conversation.caller.alive():
                raise policy.Refused(f"the calling process {conversation.caller.pid} has exited",
                                     "caller")
            return Job.start(self.helper_binary, conversation.caller, conversation.request,
                             time.monotonic() + HELPER_DEADLINE, charge)
        finally:
            cgroups.close(charge)

    def _helper_alive(self, container: str) -> bool:
        return container in self.running or any(g.container == container
                                                for g in self.exiting)

    def _blocked(self, container: str, now: float) -> bool:
        """A killed helper of this container still alive after the grace: stuck."""
        return any(g.container == container and g.job.killed_at is not None
                   and now - g.job.killed_at >= KILL_GRACE for g in self.exiting)

    def _pod_has_room(self, container: str) -> bool:
        """Whether the container's pod has fewer than PER_POD_HELPERS helpers alive."""
        pod = policy.pod_of(container)
        alive = [*self.running, *(g.container for g in self.exiting)]
        return sum(1 for c in alive if policy.pod_of(c) == pod) < shares.PER_POD_HELPERS

    def _wake_pod(self, container: str) -> None:
        """One of the pod's helpers may have gone: its other containers' waiting
        requests start, while the pod has helpers to spare."""
        pod = policy.pod_of(container)
        for other in [c for c in self.queued if c != container and policy.pod_of(c) == pod]:
            if not self._pod_has_room(other):
                return
            self.next(other)

    def _helpers_full(self) -> policy.Refused | None:
        """The node's cap, reached only by more pods than --max-pods at their share."""
        alive = len(self.running) + len(self.exiting)
        if alive >= self.caps.helpers:
            return policy.Refused(f"the broker has {alive} helpers alive, "
                                  f"{shares.PER_POD_HELPERS} for each of --max-pods "
                                  f"{self.caps.max_pods} pods; try again", "busy")
        return None

    def release(self, conversation: Conversation) -> None:
        """The request is answered: its helper leaves the loop (or, until it has exited,
        waits among the exiting: killed, and stuck if the kernel holds it past
        KILL_GRACE), and the container's next request may start."""
        job = conversation.job
        if job is not None:
            for fileobj in (job.ctl, job.pidfd):
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(fileobj)
            if job.exited():
                job.close()
            else:  # usually exiting already; its pidfd says when it is gone
                job.kill()
                exiting = Exiting(conversation.container, job)
                self.exiting.append(exiting)
                self.selector.register(job.pidfd, selectors.EVENT_READ, events.HelperGone(exiting))
            conversation.job = None
        if self.is_running(conversation):
            del self.running[conversation.container]
            self.next(conversation.container)
            self._wake_pod(conversation.container)

    def expire(self, now: float) -> None:
        """Helpers past their deadline fail their requests (soonest first, and no
        further than the first still in time); killed ones stuck past the grace."""
        while self.running:
            conversation = next(iter(self.running.values()))
            if conversation.job is None or conversation.job.deadline > now:
                break
            self.stats.stalled()
            logs.event(self.log, "broker.stalled", logging.WARNING, cgroup=conversation.container,
                       pid=conversation.caller.pid, seconds=HELPER_DEADLINE)
            self.answers.fail(conversation, HelperFailed(
                f"the request did not finish within {HELPER_DEADLINE:g}s (a FUSE "
                "filesystem on the way may not be answering)"))
            self.release(conversation)
        self._reap_stuck(now)

    def reap(self, exiting: Exiting) -> None:
        """A released helper has exited: its container may have the next one."""
        if exiting in self.exiting:
            self.exiting.remove(exiting)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(exiting.job.pidfd)
            exiting.job.close()
        self.next(exiting.container)
        self._wake_pod(exiting.container)

    def _reap_stuck(self, now: float) -> None:
        """Killed helpers that have not died are blocked in the kernel, which in a
        container means on one of its FUSE daemons: abort the connections the broker made
        for that container, which frees them, and say so; the container's waiting
        requests are answered "busy" meanwhile."""
        for exiting in list(self.exiting):
            job, container = exiting.job, exiting.container
            if job.exited():
                self.reap(exiting)
            elif (not job.aborted and job.killed_at is not None
                  and now - job.killed_at >= KILL_GRACE):
                job.aborted = True
                aborted = [n for n in self.records.connections(container) if records.abort(n)]
                self.stats.aborted(len(aborted))
                logs.event(self.log, "broker.aborted", logging.WARNING, cgroup=container,
                           connections=aborted,
                           reason=f"a helper stayed blocked {KILL_GRACE:g}s after SIGKILL")
                self.next(container)

    def close(self) -> None:
        """The broker has stopped: the exiting helpers' descriptors go."""
        for exiting in self.exiting:
            exiting.job.close()
