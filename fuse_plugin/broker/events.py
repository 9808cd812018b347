"""What the loop's selector hands back: one small type for each kind of file the loop
watches, registered as the file's ``data`` and matched whole by ``server.Broker``.

A turn serves what is ready in the order of ``urgency``: helpers first (their requests
are under way, so a mount in progress moves on every turn however many new connections
a flood has queued), then requests, then new connections. The events of one request
(``OfRequest``) name it, so that a step the broker's own shortage interrupts answers
that request "busy" (``server.Broker._survive``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fuse_plugin.broker import lxcfs
from fuse_plugin.broker.conversation import Conversation

if TYPE_CHECKING:
    from fuse_plugin.broker.scheduler import Exiting

HELPERS, REQUESTS, ACCEPTS = 0, 1, 2  # a turn's order


@dataclass(frozen=True)
class Listening:
    """The broker socket: a connection to accept."""


@dataclass(frozen=True)
class Woken:
    """The wake-up pair: a signal arrived, or ``stop`` was called."""


@dataclass(frozen=True, eq=False)
class OfRequest:
    """An event of one request."""

    conversation: Conversation


@dataclass(frozen=True, eq=False)
class FromCaller(OfRequest):
    """The caller's connection, before its request has arrived whole."""


@dataclass(frozen=True, eq=False)
class FromHelper(OfRequest):
    """The control socket of the request's helper: a report, or its end."""


@dataclass(frozen=True, eq=False)
class HelperExited(OfRequest):
    """The pidfd of the request's helper: it has exited."""


@dataclass(frozen=True, eq=False)
class HelperGone:
    """The pidfd of a released helper (killed, among the exiting): it has exited."""

    exiting: Exiting


Event = Listening | Woken | FromCaller | FromHelper | HelperExited | HelperGone | lxcfs.Event


def urgency(event: Event) -> int:
    """Where a turn serves this event: helpers, then requests, then accepts."""
    if isinstance(event, FromHelper | HelperExited | HelperGone):
        return HELPERS
    return ACCEPTS if isinstance(event, Listening) else REQUESTS


def request_of(event: Event) -> Conversation | None:
    """The request this event belongs to, if it belongs to one."""
    return event.conversation if isinstance(event, OfRequest) else None
