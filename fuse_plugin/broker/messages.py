"""Every message between the broker's loop and its helper (``native/helper.c``), declared
once: each kind's fields, which of them it must have, and how each is written.

``frames`` carries text fields; this module says which fields make which message. The
loop encodes its request and answers only through ``encode`` and decodes the helper's
reports only through ``decode``, so a field is named in one place on this side. The C
side keeps its own lists (it checks each message it hears against them, and writes its
reports at its ``say`` sites); ``tests/unit/test_broker_messages.py`` reads ``helper.c``
and holds both to these declarations, in both directions.

A kind is a frozen dataclass: a field whose default is None may be left out, every
other one must be there, and a field the kind does not declare refuses the message, as a missing
one does (``HelperFailed`` naming it). How a field is written is its annotation's
``Wire``: numbers parse strictly (``UNSIGNED``: what C printed from an unsigned number,
never a sign, a space or another script's digits), a mode is octal, a superblock's
device "0:N" gives its FUSE connection N.

The conversation (``STEPS``; ``ANSWERS`` says what the loop may answer to each report)::

    loop:   Request
    helper: Mark                       loop: Go
    helper: MountFacts | UnmountFacts  loop: Go(False) | MountVerdict | UnmountVerdict
    helper: Built (a mount's only)     loop: Go
    helper: Mounted | Unmounted

and ``Refusal`` or ``Failure`` from the helper in place of any report. A helper that
closes its end says nothing: that is ``Exited``, an event, never a message; bytes that
are no frame are ``Nonsense``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from fuse_plugin.broker import frames

# A decimal the helper printed from an unsigned 64-bit number (mount ids, ids, modes).
_DECIMAL = re.compile(r"[0-9]{1,20}")
_OCTAL = re.compile(r"[0-7]{1,7}")


class HelperFailed(Exception):
    """The helper, or the kernel through it, said no; one line for the caller."""


@dataclass(frozen=True)
class Wire:
    """How one field is written: ``read`` turns the text into its value (``ValueError``
    showing the text it refused), ``write`` the value into what ``frames.encode`` takes."""

    read: Callable[[str], object]
    write: Callable[[Any], str | Sequence[int]]


def _unsigned(text: str) -> int:
    if not _DECIMAL.fullmatch(text):
        raise ValueError(repr(text[:20]))
    return int(text)


def _octal(text: str) -> int:
    if not _OCTAL.fullmatch(text):
        raise ValueError(repr(text[:20]))
    return int(text, 8)


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(repr(text[:20]))
    return text == "1"


def _judged(text: str) -> bool | None:
    """"1" or "0", or "-": not judged (the helper runs as a root caller)."""
    return None if text == "-" else _flag(text)


def _connection(text: str) -> int:
    """A superblock's device "0:N": its FUSE connection, N in fusectl."""
    major, _, minor = text.partition(":")
    if not (_DECIMAL.fullmatch(major) and _DECIMAL.fullmatch(minor)):
        raise ValueError(f"{text[:24]!r}, not a device major:minor")
    return int(minor)


TEXT = Wire(str, str)
UNSIGNED = Wire(_unsigned, str)
OCTAL = Wire(_octal, lambda mode: f"{mode:o}")
FLAG = Wire(_flag, lambda on: "1" if on else "0")
JUDGED = Wire(_judged, lambda on: "-" if on is None else "1" if on else "0")
CONNECTION = Wire(_connection, lambda n: f"0:{n}")
GROUPS = Wire(str, tuple)  # a u32 array (frames.BINARY), only ever sent: never read

Text = Annotated[str, TEXT]
Unsigned = Annotated[int, UNSIGNED]
Octal = Annotated[int, OCTAL]
Flag = Annotated[bool, FLAG]
Judged = Annotated[bool | None, JUDGED]
Connection = Annotated[int, CONNECTION]
Groups = Annotated[tuple[int, ...], GROUPS]
MaybeText = Annotated[str | None, TEXT]
MaybeUnsigned = Annotated[int | None, UNSIGNED]


# Loop to helper (frames.REQUEST, then frames.ANSWER).

@dataclass(frozen=True)
class Request:
    """What to do, and as whom: the helper's walk and checks run with these ids."""

    op: Text  # mount or unmount
    path: Text
    uid: Unsigned
    gid: Unsigned
    groups: Groups
    fuse_fd: MaybeUnsigned = None  # a mount's: the caller's /dev/fuse fd number


@dataclass(frozen=True)
class Go:
    """Go on (True) or stop (False): the answer to the mark and to built, and the
    refusal at any step."""

    go: Flag


@dataclass(frozen=True)
class MountVerdict:
    """Go on and mount, with these parameters (``policy.MountOptions``, judged)."""

    source: Text
    subtype: Text
    max_read: Text  # "" or a number policy.options checked
    flags: Text  # fsconfig flags, comma-separated
    attrs: Text  # mount attributes beyond nosuid,nodev, comma-separated
    go: Flag = True


@dataclass(frozen=True)
class UnmountVerdict:
    """Go on and unmount, lazily or not."""

    lazy: Flag
    go: Flag = True


Answer = Go | MountVerdict | UnmountVerdict
GO, STOP = Go(True), Go(False)


# Helper to loop (frames.REPORT): the field "status" names the kind.

@dataclass(frozen=True)
class Mark:
    """The mount at /run/fuse-broker in the caller's namespace (Allocate's), or ""."""

    STATUS: ClassVar[str] = "mark"
    mark_dev: Text
    mark_root: Text


@dataclass(frozen=True)
class MountFacts:
    """What a mount's path reached: the directory and the mount it is on."""

    STATUS: ClassVar[str] = "facts"
    mount: Unsigned
    fstype: Text
    mount_point: Text
    shared: Flag
    mode: Octal
    owner: Unsigned
    writable: Judged
    uid: Unsigned
    gid: Unsigned


@dataclass(frozen=True)
class UnmountFacts:
    """The mount on top at an unmount's path."""

    STATUS: ClassVar[str] = "facts"
    mount: Unsigned
    fstype: Text
    dev: Connection


@dataclass(frozen=True)
class Built:
    """The new mount's superblock exists; the mount is still detached."""

    STATUS: ClassVar[str] = "built"
    dev: Connection


@dataclass(frozen=True)
class Mounted:
    """Mounted: its id, connection and options as the mount table shows them."""

    STATUS: ClassVar[str] = "ok"
    mnt_id: Unsigned
    dev: Connection
    options: Text


@dataclass(frozen=True)
class Unmounted:
    STATUS: ClassVar[str] = "ok"
    mnt_id: Unsigned


@dataclass(frozen=True)
class Refusal:
    """A rule about the target said no; ``kind`` for the log and metrics."""

    STATUS: ClassVar[str] = "refused"
    message: Text
    kind: Text


@dataclass(frozen=True)
class Failure:
    """The system said no (or the helper could not say its report whole)."""

    STATUS: ClassVar[str] = "failed"
    message: Text
    kind: MaybeText = None  # sent with every outcome, read only with a refusal


@dataclass(frozen=True)
class Exited:
    """The helper closed its end without a further word (it exited, or was killed)."""


@dataclass(frozen=True)
class Nonsense:
    """What arrived on the helper's socket is not a frame (``frames.FrameError``)."""

    why: str


# What the loop hears from its helper: a report's fields, or one of the two events.
Heard = dict[str, str] | Exited | Nonsense


Report = Mark | MountFacts | UnmountFacts | Built | Mounted | Unmounted | Refusal | Failure
REPORTS: tuple[type[Report], ...] = typing.get_args(Report)
OUTCOMES: tuple[type[Refusal | Failure], ...] = (Refusal, Failure)  # in place of any step
STEPS: dict[str, tuple[type[Report], ...]] = {
    "mount": (Mark, MountFacts, Built, Mounted),
    "unmount": (Mark, UnmountFacts, Unmounted),
}
ANSWERS: dict[type[Report], tuple[type[Answer], ...]] = {
    Mark: (Go,), MountFacts: (Go, MountVerdict), UnmountFacts: (Go, UnmountVerdict),
    Built: (Go,),
}


def wires(kind: type) -> dict[str, Wire]:
    """A kind's fields in order, each with how it is written."""
    hints = typing.get_type_hints(kind, include_extras=True)
    return {f.name: hints[f.name].__metadata__[0] for f in dataclasses.fields(kind)}


def required(kind: type) -> frozenset[str]:
    """The fields a message of ``kind`` must have: all but those that may be None."""
    return frozenset(f.name for f in dataclasses.fields(kind) if f.default is not None)


def encode(message: Request | Answer) -> bytes:
    """The frame of a request or an answer; a field left None is not sent.
    ``frames.FrameError`` when it cannot be said whole."""
    frame = frames.REQUEST if isinstance(message, Request) else frames.ANSWER
    fields = {name: wire.write(value) for name, wire in wires(type(message)).items()
              if (value := getattr(message, name)) is not None}
    return frames.encode(frame, fields)


def decode(fields: Mapping[str, str], kind: type[Report]) -> Report:
    """The report ``fields`` (with their "status") as ``kind``; ``HelperFailed`` naming
    the field that is missing, unknown or does not parse."""
    status = fields.get("status", "")[:20]
    wire = wires(kind)
    unknown = sorted(set(fields) - set(wire) - {"status"})
    if unknown:
        raise HelperFailed(f"the helper's {status!r} report has an unknown field "
                           f"{unknown[0][:20]!r}")
    for name in sorted(required(kind) - set(fields)):
        raise HelperFailed(f"the helper's {status!r} report has no {name} field")
    values: dict[str, Any] = {}
    for name, value in fields.items():
        if name == "status":
            continue
        try:
            values[name] = wire[name].read(value)
        except ValueError as bad:
            raise HelperFailed(f"the helper sent a bad {name}: {bad}") from None
    return kind(**values)
