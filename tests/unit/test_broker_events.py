"""What the loop's selector hands back (``events``): a turn serves helpers first, then
requests, then new connections, so under a flood a mount already under way moves on
every turn; and a step a shortage interrupts finds the request it belongs to in the
event itself (``server.Broker._survive``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import cast

import pytest

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import events, lxcfs
from fuse_plugin.broker.conversation import Conversation
from fuse_plugin.broker.helper import Job
from fuse_plugin.broker.scheduler import Exiting


@pytest.fixture
def conversation() -> Iterator[Conversation]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        who = callers.Caller(pid=1, uid=0, gid=0, pidfd=-1, container="/pod/a")
        yield Conversation(ours, who, time.monotonic() + 5)


def test_a_turn_serves_helpers_then_requests_then_accepts(
        conversation: Conversation) -> None:
    gone = Exiting("/pod/a", cast("Job", object()))
    ready: list[events.Event] = [
        events.Listening(), events.FromCaller(conversation), events.Woken(),
        lxcfs.Event("instance", object()), events.HelperGone(gone),
        events.FromHelper(conversation), events.HelperExited(conversation)]
    ordered = sorted(ready, key=events.urgency)
    assert [type(e) for e in ordered] == [
        events.HelperGone, events.FromHelper, events.HelperExited,
        events.FromCaller, events.Woken, lxcfs.Event, events.Listening]


def test_only_a_requests_own_events_name_it(conversation: Conversation) -> None:
    for event in (events.FromCaller(conversation), events.FromHelper(conversation),
                  events.HelperExited(conversation)):
        assert events.request_of(event) is conversation
    gone = Exiting("/pod/a", cast("Job", object()))
    for other in (events.Listening(), events.Woken(), events.HelperGone(gone),
                  lxcfs.Event("bind", object())):
        assert events.request_of(other) is None
