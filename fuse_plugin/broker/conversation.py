"""One request, from its connection to its reply: what the loop knows about it, the
steps its helper has reported, and the judgements those steps need.

The loop (``server.Broker``) owns sockets, helpers and limits; this module owns what a
single request means: the rules on its strings and its admission under the mount caps
before any helper runs (``prepare``: a mount takes its ``admission.Slot``), the verdict
on what the helper reached (``verdict``), and the record of a mount before it becomes
visible (``record``). Each of the helper's reports is read in its turn
(``hear``, ``reports.STEPS``): a report out of turn fails the request.

Where a request is (``State``) moves only along ``TRANSITIONS``, by ``advance``, which
refuses any other move: a request is answered once, and one whose helper was told to go
on past the facts (``JUDGED``) is never handed to another broker (``acting``).
"""

from __future__ import annotations

import enum
import socket
import time
from dataclasses import dataclass, field

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import messages, policy, protocol, records, reports
from fuse_plugin.broker.admission import Admission, Slot
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.shares import Ticket


class State(enum.Enum):
    """Where one request is, from its connection to its end."""

    CONNECTED = "connected"  # accepted; its request has not arrived whole
    QUEUED = "queued"  # admitted; it waits for its container's helper (``scheduler``)
    RUNNING = "running"  # its helper looks: the caller's mark, the path's facts
    JUDGED = "judged"  # its helper was told to go on: it may build a mount or unmount
    BINDING = "binding"  # an lxcfs request, handed to ``lxcfs.Views``
    ANSWERED = "answered"  # replied to: done, refused or failed
    DROPPED = "dropped"  # the caller closed its connection without a request


TRANSITIONS: dict[State, frozenset[State]] = {
    State.CONNECTED: frozenset({State.QUEUED, State.BINDING, State.ANSWERED, State.DROPPED}),
    State.QUEUED: frozenset({State.RUNNING, State.ANSWERED}),
    State.RUNNING: frozenset({State.JUDGED, State.ANSWERED}),
    State.JUDGED: frozenset({State.ANSWERED}),
    State.BINDING: frozenset({State.ANSWERED}),
    State.ANSWERED: frozenset(),
    State.DROPPED: frozenset(),
}


class IllegalTransition(Exception):
    """A move ``TRANSITIONS`` does not allow: a bug in the loop, which ends it."""


@dataclass
class Conversation:
    """One identified connection, from accept to its reply."""

    sock: socket.socket
    caller: callers.Caller
    deadline: float
    parsed: protocol.Request | None = None
    options: policy.MountOptions = field(default_factory=policy.MountOptions)
    job: Job | None = None
    started: float = field(default_factory=time.perf_counter)
    fields: dict[str, object] = field(default_factory=dict)
    state: State = State.CONNECTED
    watched: bool = False  # registered with the selector until its request arrives
    heard: int = 0  # the helper's reports taken so far
    slot: Slot | None = None  # a mount's place under the caps, from admission to its end
    unmounting: int | None = None  # an unmount's FUSE connection, once judged
    ticket: Ticket | None = None  # its place among the open requests, until it ends

    @property
    def container(self) -> str:
        return self.caller.container

    @property
    def request(self) -> protocol.Request:
        assert self.parsed is not None, "only parsed requests reach a helper"
        return self.parsed

    @property
    def acting(self) -> bool:
        """Its helper was told to go on past the facts, so it may have built a mount or
        unmounted: the request cannot be handed to another broker. Before, it has only
        looked (the caller's mark, the path); a killed helper leaves nothing behind."""
        return self.state is State.JUDGED

    @property
    def ended(self) -> bool:
        """Answered, or dropped unanswered: nothing more happens to it."""
        return not TRANSITIONS[self.state]

    def advance(self, to: State) -> None:
        """Move to ``to``; ``IllegalTransition`` if ``TRANSITIONS`` has no such move
        (the request stays where it was)."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"a request {self.state.value} cannot become {to.value}")
        self.state = to

    def prepare(self, data: bytes, admission: Admission) -> None:
        """Everything that needs no helper: the message, the rules on strings, admission
        under the caps (a mount's slot, given back by the loop when the request ends),
        the caller's namespaces. ``policy.Refused`` when a rule says no."""
        who = self.caller
        try:
            request = protocol.parse_request(data)
        except protocol.BadRequest as bad:
            raise policy.Refused(str(bad), "request") from None
        self.parsed = request
        self.fields.update(op=request.op, path=request.path[:policy.MAX_PATH])
        policy.path(request.path)
        if request.op == "mount":
            self.fields["options"] = request.options[:policy.MAX_OPTIONS]
            self.options = policy.options(request.options)
            self.slot = admission.admit(who.container)
        elif not admission.records.connections(who.container):
            # Only a mount the broker made for this container may be unmounted: with none
            # recorded, the answer needs no helper (an unmount flood cost one each, ten
            # times a refusal by the rules).
            raise policy.Refused("it is not a mount the broker made for this container (it "
                                 "holds none); the broker removes only its own", "unmount")
        who.open()
        self.fields["namespace"] = who.namespace

    def hear(self, message: messages.Heard) -> reports.Report:
        """The helper's next report, if it is the one this step expects."""
        report = reports.read(message, self.request.op, self.heard)
        self.heard += 1
        return report

    def verdict(self, report: reports.MountFacts | reports.UnmountFacts,
                store: records.Records, allow_other: bool) -> messages.Answer:
        """Judge what the helper reached (an unmount against ``store``, the records of the
        mounts the broker made); the mount's (or unmount's) parameters, and the request
        is ``JUDGED``, or ``policy.Refused``."""
        who = self.caller
        if isinstance(report, reports.MountFacts):
            policy.may_mount(report.target, self.options, who.node_root, allow_other,
                             user_namespaced=who.user_ns != -1)
            self.advance(State.JUDGED)
            options = self.options
            return messages.MountVerdict(
                source=options.source, subtype=options.subtype, max_read=options.max_read,
                flags=",".join(options.flags), attrs=",".join(options.attrs))
        found = report.found
        policy.may_unmount(found, store.owner(found.connection), container=who.container,
                           uid=who.uid, node_root=who.node_root,
                           mount_id=self.request.mount_id)
        self.fields["mount_id"] = found.mount_id
        self.unmounting = found.connection
        self.advance(State.JUDGED)
        return messages.UnmountVerdict(lazy="lazy" in self.request.flags)

    def record(self, built: reports.Built, store: records.Records) -> records.Record:
        """The record of the new connection, made while its mount is still detached, so
        a broker killed at any instant leaves no mount it made that it does not count
        and cannot remove. No record, no mount: ``HelperFailed`` releases the helper,
        and the detached mount goes with it."""
        connection = built.connection
        if store.owner(connection) is not None:
            # The kernel mounts a /dev/fuse already in use as one more mount of its
            # superblock: one connection, any number of mount points, one record.
            raise policy.Refused(f"this /dev/fuse already serves a mount (FUSE connection "
                                 f"{connection}): open /dev/fuse again for another mount",
                                 "allocation")
        inode = store.inode_of(connection)
        if inode is None:
            raise reports.HelperFailed(f"the new FUSE connection {connection} is not in "
                                       "fusectl")
        self.fields["connection"] = connection
        return records.Record(connection=connection, ctl_inode=inode,
                              container=self.container, uid=self.caller.uid,
                              namespace=self.caller.namespace, mount_id=0,
                              path=self.request.path)

    def done(self, report: reports.Done) -> None:
        self.fields["mount_id"] = report.mount_id
        if report.connection is not None:
            self.fields.update(connection=report.connection, mount_options=report.options)
