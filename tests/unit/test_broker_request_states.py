"""A request's states (``conversation.State``): every move the loop makes is one of
``TRANSITIONS``, and every other move is refused with the request left where it was, so
a request answered twice, a helper started for an answered request or a judged request
handed back to a queue ends the loop as a bug instead of happening."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.broker import caller as callers
from fuse_plugin.broker import policy, protocol
from fuse_plugin.broker.conversation import TRANSITIONS, Conversation, IllegalTransition, State
from fuse_plugin.broker.server import Broker
from fuse_plugin.broker.settings import BrokerSettings

# How the loop takes a request to each state, from its accept (server.py, scheduler.py).
PATHS: dict[State, tuple[State, ...]] = {
    State.CONNECTED: (),
    State.QUEUED: (State.QUEUED,),
    State.RUNNING: (State.QUEUED, State.RUNNING),
    State.JUDGED: (State.QUEUED, State.RUNNING, State.JUDGED),
    State.BINDING: (State.BINDING,),
    State.ANSWERED: (State.QUEUED, State.RUNNING, State.JUDGED, State.ANSWERED),
    State.DROPPED: (State.DROPPED,),
}

# Every way a request ends in the loop, step by step.
LIVES: dict[str, tuple[State, ...]] = {
    "refused at its request (rules, caps, deadline, stopping)": (State.ANSWERED,),
    "closed without a request": (State.DROPPED,),
    "lxcfs views bound or refused": (State.BINDING, State.ANSWERED),
    "refused while queued (helpers full, blocked, stopping)": (State.QUEUED, State.ANSWERED),
    "refused or failed while its helper looks": (State.QUEUED, State.RUNNING, State.ANSWERED),
    "done, or failed after the verdict": (State.QUEUED, State.RUNNING, State.JUDGED,
                                          State.ANSWERED),
}


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        yield ours, theirs


def at(state: State, sock: socket.socket) -> Conversation:
    """A request taken to ``state`` the way the loop takes it."""
    who = callers.Caller(pid=1, uid=0, gid=0, pidfd=-1, container="/pod/a")
    conversation = Conversation(sock, who, time.monotonic() + 5)
    for step in PATHS[state]:
        conversation.advance(step)
    assert conversation.state is state
    return conversation


def test_every_state_is_reached_and_only_the_ends_have_no_way_on() -> None:
    assert set(PATHS) == set(State) == set(TRANSITIONS)
    assert {s for s, ways in TRANSITIONS.items() if not ways} == {State.ANSWERED,
                                                                  State.DROPPED}


@pytest.mark.parametrize("life", list(LIVES))
def test_each_way_a_request_goes_is_allowed_and_ends_it(
        life: str, pair: tuple[socket.socket, socket.socket]) -> None:
    conversation = at(State.CONNECTED, pair[0])
    for step in LIVES[life]:
        assert not conversation.ended
        conversation.advance(step)
    assert conversation.ended
    assert conversation.state in (State.ANSWERED, State.DROPPED)


ILLEGAL = [(before, after) for before in State for after in State
           if after not in TRANSITIONS[before]]


@pytest.mark.parametrize(("before", "after"), ILLEGAL,
                         ids=[f"{b.value}-{a.value}" for b, a in ILLEGAL])
def test_every_other_move_is_refused_and_the_request_stays(
        before: State, after: State, pair: tuple[socket.socket, socket.socket]) -> None:
    conversation = at(before, pair[0])
    with pytest.raises(IllegalTransition, match=f"a request {before.value} cannot "
                                                f"become {after.value}"):
        conversation.advance(after)
    assert conversation.state is before


def test_the_moves_the_loop_must_never_make_are_among_the_refused() -> None:
    """Answered twice; a helper for a request not queued; a request whose helper may have
    mounted sent back to wait, or refused as if nothing happened (its drain refuses
    only requests that are not acting)."""
    for move in [(State.ANSWERED, State.ANSWERED), (State.DROPPED, State.ANSWERED),
                 (State.CONNECTED, State.RUNNING), (State.ANSWERED, State.RUNNING),
                 (State.JUDGED, State.QUEUED), (State.JUDGED, State.RUNNING),
                 (State.BINDING, State.QUEUED)]:
        assert move in ILLEGAL, move


def test_only_a_judged_request_is_acting(pair: tuple[socket.socket, socket.socket]) -> None:
    assert [s for s in State if at(s, pair[0]).acting] == [State.JUDGED]


def test_the_loop_answers_a_request_once(tmp_path: Path,
                                          pair: tuple[socket.socket, socket.socket]) -> None:
    """The loop's reply moves the request to ANSWERED: a second reply is a bug, refused
    before anything is sent, and the caller has the first answer alone."""
    broker = Broker(BrokerSettings(directory=tmp_path / "dir", state=tmp_path / "state",
                                   lxcfs_dir=tmp_path / "lxcfs"), logging.getLogger("test"))
    ours, theirs = pair
    conversation = at(State.CONNECTED, ours)
    broker.replies.refuse(conversation, policy.Refused("first", "request"))
    with pytest.raises(IllegalTransition, match="a request answered cannot become answered"):
        broker.replies.refuse(conversation, policy.Refused("second", "request"))
    theirs.setblocking(False)
    assert protocol.decode(theirs.recv(protocol.MAX_MESSAGE))["message"] == \
        "broker refused: first"
    assert theirs.recv(protocol.MAX_MESSAGE) == b""  # closed after the one answer
