"""Every request the broker holds, from its connection to its answer: the handlers the
loop's events lead to (``server.Broker._dispatch``).

A connection accepted is named by the kernel and admitted among the open requests
(``shares``), or answered at once (``connected``). It is ``CONNECTED`` until its request
has arrived whole (``receive``), within REQUEST_DEADLINE of its accept (``expire``); the
table of those is kept in the order their deadlines fall, so its first entry has the
soonest (``soonest``). Then the request is refused, handed to the LXCFS views
(``lxcfs.Views``) or queued for its container's helper (``scheduler``); the helper's
reports are heard in turn (``hear``), each answered go or no, and its exit ends what it
had not finished (``exited``). How a request ends is ``replies``; what its states may
be, ``conversation.State``.
"""

from __future__ import annotations

import itertools
import selectors
import socket
import time
from collections.abc import Callable

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import events, lxcfs, policy, protocol
from fuse_plugin.broker.admission import Admission
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.messages import GO, STOP, Exited
from fuse_plugin.broker.records import Records
from fuse_plugin.broker.replies import Replies
from fuse_plugin.broker.reports import Built, Done, HelperFailed, Marked, MountFacts, UnmountFacts
from fuse_plugin.broker.scheduler import Scheduler
from fuse_plugin.broker.settings import BrokerSettings
from fuse_plugin.broker.shares import OpenRequests, Ticket

REQUEST_DEADLINE = 5.0  # seconds from accept to a complete request


class Requests:
    """The requests the loop holds and what moves them on; used by the broker's loop
    thread only."""

    def __init__(self, selector: selectors.BaseSelector, settings: BrokerSettings, *,
                 admission: Admission, open_requests: OpenRequests, store: Records,
                 helpers: Scheduler, replies: Replies, pause: Callable[[OSError], None]
                 ) -> None:
        self._selector = selector
        self.settings = settings
        self.admission = admission
        self.open = open_requests
        self.records = store
        self.helpers = helpers
        self.replies = replies
        self._pause = pause  # the loop's: out of descriptors, accepting pauses
        self._mark = policy.Mark("", "")  # the broker directory's, from ``serve``
        self.views: lxcfs.Views | None = None  # LXCFS views, from ``serve``
        self._waiting: dict[int, Conversation] = {}  # by socket fd: no complete request yet

    def serve(self, mark: policy.Mark, views: lxcfs.Views) -> None:
        """The broker has started: its directory's mark and its LXCFS views."""
        self._mark = mark
        self.views = views

    def connected(self, sock: socket.socket) -> None:
        """A connection accepted: the kernel names the caller, and it is admitted among
        the open requests (``shares``) or answered at once."""
        who: callers.Caller | None = None
        ticket: Ticket | None = None
        refused: policy.Refused | None = None
        try:
            who = callers.identify(sock)
            ticket = self.open.admit(who.container)
        except policy.OutOfResources as refusal:
            self._pause(refusal.error)
            refused = refusal
        except policy.Refused as refusal:
            refused = refusal
        except OSError as err:
            refused = policy.Refused(f"cannot identify the caller: "
                                     f"{err.strerror or err}", "caller")
        if refused is not None:
            self.replies.refuse_at_accept(sock, who, refused)
            return
        assert who is not None
        assert ticket is not None
        self._arrived(sock, who, ticket)

    def _arrived(self, sock: socket.socket, who: callers.Caller, ticket: Ticket) -> None:
        """A connection admitted (its place among the open requests, ``ticket``). The
        shim sends as soon as it connects, so the request is usually there already: read
        now rather than after another turn of the selector."""
        conversation = Conversation(sock, who, time.monotonic() + REQUEST_DEADLINE, ticket=ticket)
        conversation.fields.update(pid=who.pid, uid=who.uid, cgroup=who.container)
        self._waiting[sock.fileno()] = conversation
        self.receive(conversation)

    def soonest(self) -> list[float]:
        """The deadline of the oldest connection whose request has not arrived."""
        return [w.deadline for w in itertools.islice(self._waiting.values(), 1)]

    def expire(self, now: float) -> None:
        """Connections whose request has not arrived by their deadline are refused,
        soonest first, and no further than the first still in time."""
        while self._waiting:
            conversation = next(iter(self._waiting.values()))
            if conversation.deadline > now:
                break
            self._unwait(conversation)
            self.replies.refuse(conversation, policy.Refused(
                f"no complete request within {REQUEST_DEADLINE:g}s", "request"))

    def take_waiting(self) -> list[Conversation]:
        """Every connection whose request has not arrived, out of the selector (the
        drain refuses them)."""
        waiting = list(self._waiting.values())
        for conversation in waiting:
            self._unwait(conversation)
        return waiting

    def abandon(self, conversation: Conversation, refused: policy.Refused) -> None:
        """Answer a request that a shortage interrupted, wherever it was."""
        if self._waiting.get(conversation.sock.fileno()) is conversation:
            self._unwait(conversation)
        self.helpers.withdraw(conversation)
        if conversation.job is not None and conversation.job.ctl.fileno() != -1:
            conversation.job.send(STOP)
        if not conversation.ended:
            self.replies.refuse(conversation, refused)
        self.helpers.release(conversation)

    def receive(self, conversation: Conversation) -> None:
        """Its request, if it has arrived whole: refused, handed to lxcfs, or queued for
        its helper; if not yet, the connection is watched (``events.FromCaller``)."""
        try:
            data = conversation.sock.recv(protocol.MAX_MESSAGE + 1)
        except BlockingIOError:
            if not conversation.watched:
                self._selector.register(conversation.sock, selectors.EVENT_READ,
                                        events.FromCaller(conversation))
                conversation.watched = True
            return
        except OSError:
            data = b""
        self._unwait(conversation)
        if not data:
            self.replies.drop(conversation)
            return
        if self.views is not None and lxcfs.asks(data):
            conversation.advance(State.BINDING)
            self.views.request(conversation, data)
            return
        try:
            conversation.prepare(data, self.admission)
        except policy.Refused as refused:
            if isinstance(refused, policy.OutOfResources):
                self._pause(refused.error)
            self.replies.refuse(conversation, refused)
            return
        self.helpers.queue(conversation)

    def _unwait(self, conversation: Conversation) -> None:
        """The connection leaves the selector: its request arrived, or it never will."""
        if conversation.watched:
            self._selector.unregister(conversation.sock)
            conversation.watched = False
        del self._waiting[conversation.sock.fileno()]

    def hear(self, conversation: Conversation) -> None:
        """The helper's next report, and the loop's answer to it."""
        job = conversation.job
        if job is None or not self.helpers.is_running(conversation):
            return  # an event for a helper that was released earlier in this turn
        message = job.receive()
        if message is None:
            return
        try:
            report = conversation.hear(message)
            if isinstance(report, Marked):
                policy.allocated(report.mark, self._mark)
                job.send(GO)
            elif isinstance(report, MountFacts | UnmountFacts):
                job.send(conversation.verdict(report, self.records, self.settings.allow_other))
            elif isinstance(report, Built):
                self._record(conversation, report)
                job.send(GO)
            else:
                self._succeed(conversation, report)
            return
        except policy.Refused as refused:
            job.send(STOP)
            self.replies.refuse(conversation, refused)
        except HelperFailed as failed:
            self.replies.fail(conversation, failed)
        self.helpers.release(conversation)

    def _record(self, conversation: Conversation, built: Built) -> None:
        """Crash-only records: the new mount is recorded while still detached
        (``Conversation.record``), in its slot's place in the count; a record the broker
        cannot write is no mount."""
        record = conversation.record(built, self.records)
        assert conversation.slot is not None, "a mount is admitted before its helper starts"
        try:
            self.admission.commit(conversation.slot, record)
        except OSError as err:
            if policy.out_of_resources(err):
                self._pause(err)
            raise HelperFailed(f"cannot record the mount: {err.strerror or err}") from None

    def _succeed(self, conversation: Conversation, done: Done) -> None:
        conversation.done(done)
        if conversation.unmounting is not None:
            self.admission.unmounted(conversation.unmounting)
        self.replies.served(conversation, conversation.request.op, mount_id=done.mount_id)
        self.helpers.release(conversation)

    def exited(self, conversation: Conversation) -> None:
        """The helper's pidfd: it has exited. A request it had not finished fails."""
        job = conversation.job
        if job is None:
            return
        message = job.receive()  # a last word it sent before exiting
        if self.helpers.is_running(conversation):
            try:
                report = conversation.hear(Exited() if message is None else message)
                if not isinstance(report, Done):
                    raise HelperFailed("the broker's helper exited without an answer")
                self._succeed(conversation, report)
                return
            except policy.Refused as refused:
                self.replies.refuse(conversation, refused)
            except HelperFailed as failed:
                self.replies.fail(conversation, failed)
            self.helpers.release(conversation)

    def answer_lxcfs(self, conversation: Conversation, outcome: policy.Refused | str | None,
                     later: bool) -> None:
        """How an lxcfs request (lxcfs.Views) ended: bound, refused or failed."""
        if outcome is None:
            self.replies.served(conversation, lxcfs.OP)
        elif isinstance(outcome, policy.Refused):
            if isinstance(outcome, policy.OutOfResources):
                self._pause(outcome.error)
            self.replies.refuse(conversation, outcome, later=later)
        else:
            self.replies.fail(conversation, HelperFailed(outcome))
