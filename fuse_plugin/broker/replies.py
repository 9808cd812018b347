"""How every request ends: its one reply, its one log line, and what it held given back.

A request ends in ``Replies.reply`` (done, refused or failed) or ``Replies.drop`` (the
caller left without a request), however it went: the rules, a deadline, its helper, the
broker stopping. Either gives back its mount slot and its place among the open requests
before the answer (``_end``), and moves it to its last state (``conversation.State``),
which a second answer cannot leave. Its line is written before the reply, within each
tenant's budget (``budget``); a connection refused at accept is answered at once and
logged as one line a second however many there are.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

from fuse_plugin import logs
from fuse_plugin.broker import budget, lxcfs, policy, protocol
from fuse_plugin.broker import caller as callers
from fuse_plugin.broker.admission import Admission
from fuse_plugin.broker.conversation import Conversation, State
from fuse_plugin.broker.reports import HelperFailed
from fuse_plugin.broker.shares import OpenRequests
from fuse_plugin.broker.stats import BrokerStats


class Replies:
    """The loop's answers and their lines; used by the broker's loop thread only."""

    def __init__(self, log: logging.Logger, stats: BrokerStats, admission: Admission,
                 open_requests: OpenRequests) -> None:
        self.log = log
        self.stats = stats
        self.admission = admission
        self.open = open_requests
        self._budget = budget.LogBudget()  # lines per tenant and kind of refusal
        self._busy = 0  # refused at accept since the last summary line
        self._busy_said = 0.0

    def served(self, conversation: Conversation, op: str, **fields: object) -> None:
        """The request was done: ``broker.OP`` and ``ok``."""
        self.stats.served(op)
        self._log(conversation, f"broker.{op}", logging.INFO)
        self.reply(conversation, status="ok", **fields)

    def refuse(self, conversation: Conversation, refused: policy.Refused,
               retry: bool = False, later: bool = False) -> None:
        """``retry``: nothing of the request was done and the broker is going away; the
        shim asks the next one (protocol.RETRY_FIELD). ``later``: no lxcfs serves yet;
        the shim asks again within its wait (lxcfs.LATER_FIELD)."""
        conversation.fields.update(reason=str(refused), kind=refused.kind)
        if retry:
            conversation.fields["retry"] = True
        self.stats.refused(refused.kind)
        if self._budget.admit(conversation.container, refused.kind, str(refused), time.monotonic()):
            self._log(conversation, "broker.refused", logging.WARNING)
        self.reply(conversation, status="error", message=f"broker refused: {refused}",
                   **({protocol.RETRY_FIELD: 1} if retry else {}),
                   **({lxcfs.LATER_FIELD: 1} if later else {}))

    def fail(self, conversation: Conversation, failed: HelperFailed) -> None:
        conversation.fields["reason"] = str(failed)
        self.stats.failed()
        if self._budget.admit(conversation.container, "failed", str(failed), time.monotonic()):
            self._log(conversation, "broker.failed", logging.ERROR)
        self.reply(conversation, status="error", message=f"broker: {failed}")

    def refuse_at_accept(self, sock: socket.socket, who: callers.Caller | None,
                         refused: policy.Refused) -> None:
        """Answered at once, so that a flood holds no slot (the shim reads the answer
        even when its send finds the connection closed), and logged as one line a second
        however many there are."""
        self.stats.refused(refused.kind)
        self._busy += 1
        now = time.monotonic()
        if now - self._busy_said >= 1.0:
            logs.event(self.log, "broker.refused", logging.WARNING, connections=self._busy,
                       kind=refused.kind, reason=budget.bounded(str(refused)),
                       pid=who.pid if who else 0,
                       cgroup=budget.bounded(who.container if who else ""))
            self._busy, self._busy_said = 0, now
        answer(sock, protocol.encode(status="error", message=f"broker refused: {refused}"))
        if who is not None:
            who.close()

    def _log(self, conversation: Conversation, event: str, level: int) -> None:
        # Logged before the reply: whoever sees the answer can already find its line.
        took = time.perf_counter() - conversation.started
        conversation.fields["duration_ms"] = round(took * 1000, 2)
        logs.event(self.log, event, level,
                   **{k: budget.bounded(v) for k, v in conversation.fields.items()})

    def summarise(self, now: float, everything: bool = False) -> None:
        """One line per container and kind whose refusals went unlogged this interval."""
        for summary in self._budget.due(now, everything):
            logs.event(self.log, "broker.refused_summary", logging.WARNING,
                       cgroup=budget.bounded(summary.container), kind=summary.kind,
                       suppressed=summary.suppressed, seconds=summary.seconds,
                       last_reason=budget.bounded(summary.reason))

    def reply(self, conversation: Conversation, **fields: object) -> None:
        conversation.advance(State.ANSWERED)
        self._end(conversation)
        answer(conversation.sock, protocol.encode(**fields))
        conversation.caller.close()

    def drop(self, conversation: Conversation) -> None:
        conversation.advance(State.DROPPED)
        self._end(conversation)
        conversation.sock.close()
        conversation.caller.close()

    def _end(self, conversation: Conversation) -> None:
        """Every request ends in ``reply`` or ``drop``, however it went (done, refused,
        failed, past its deadline, the broker stopping), so a mount's slot is given back
        here, once (a slot its record took counts as that record), and so is its place
        among the open requests, both before the answer: a caller that asks again on
        hearing it finds them free."""
        self.admission.release(conversation.slot)
        conversation.slot = None
        self.open.release(conversation.ticket)
        conversation.ticket = None


def answer(sock: socket.socket, message: bytes) -> None:
    """Send the one reply and close. Closing a unix socket with unread messages makes
    the peer's next read fail (ECONNRESET) before it sees the reply: so further sends are
    shut out first and whatever arrived is drained (a few messages at most; the socket
    carries no descriptors)."""
    with contextlib.suppress(OSError):
        sock.send(message)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
        while sock.recv(protocol.MAX_MESSAGE + 1):
            pass
    sock.close()
