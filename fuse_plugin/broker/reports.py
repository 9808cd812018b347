"""What the helper (``native/helper.c``) reports, decoded once, into types.

The helper speaks in ``frames`` of text fields; this module is the only place that reads
those fields. Each report is one step of a request, and the steps come in one order:

    mount:    mark -> facts -> built -> ok
    unmount:  mark -> facts -> ok

A report of another step, or one whose numbers do not parse, fails the request
(``HelperFailed``): the loop never acts on a message that arrived out of turn, so a
helper that said ``ok`` before ``facts`` (whatever made it) mounts nothing unjudged.
A refusal or a failure the helper reports is raised as ``policy.Refused`` or
``HelperFailed`` at any step. A report without a field its step reads fails the request
too (``field``): ``native/helper.c`` sends every one of them at every ``say`` site, so a
missing field is a helper that is not ours, never a value to guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fuse_plugin.broker import policy

# A decimal the helper printed from an unsigned 64-bit number (mount ids, ids, modes).
UNSIGNED = re.compile(r"[0-9]{1,20}")
STEPS = {"mount": ("mark", "facts", "built", "ok"), "unmount": ("mark", "facts", "ok")}


class HelperFailed(Exception):
    """The helper, or the kernel through it, said no; one line for the caller."""


@dataclass(frozen=True)
class Marked:
    """Step 1: the mount at /run/fuse-broker in the caller's namespace (Allocate's)."""

    mark: policy.Mark


@dataclass(frozen=True)
class MountFacts:
    """Step 2 of a mount: what the path reached (the loop judges it)."""

    target: policy.Target


@dataclass(frozen=True)
class UnmountFacts:
    """Step 2 of an unmount: the mount on top at the path."""

    found: policy.Existing


@dataclass(frozen=True)
class Built:
    """Step 3 of a mount: the superblock exists, its mount still detached."""

    connection: int


@dataclass(frozen=True)
class Done:
    """The last step: mounted (or unmounted)."""

    mount_id: int
    connection: int | None = None  # a mount's
    options: str | None = None  # a mount's, as the kernel shows them


Report = Marked | MountFacts | UnmountFacts | Built | Done


def read(message: dict[str, str], op: str, step: int) -> Report:
    """The helper's ``step``-th report (from 0) for ``op``: ``policy.Refused`` or
    ``HelperFailed`` if it refuses or fails, ``HelperFailed`` if it is not the report
    this step expects or does not parse."""
    raise_outcome(message)
    status = field(message, "status")
    steps = STEPS[op]
    expected = steps[step] if step < len(steps) else "nothing more"
    if status != expected:
        raise HelperFailed(f"the helper said {status[:20]!r} where {expected!r} comes")
    if status == "mark":
        return Marked(policy.Mark(field(message, "mark_dev"), field(message, "mark_root")))
    if status == "facts" and op == "mount":
        return MountFacts(policy.Target(
            mount_id=number(message, "mount"), fstype=field(message, "fstype"),
            mount_point=field(message, "mount_point"), shared=field(message, "shared") == "1",
            mode=int(_octal(message, "mode"), 8), owner=number(message, "owner"),
            writable={"1": True, "0": False}.get(field(message, "writable")),
            uid=number(message, "uid"), gid=number(message, "gid")))
    if status == "facts":
        return UnmountFacts(policy.Existing(
            mount_id=number(message, "mount"), fstype=field(message, "fstype"),
            connection=connection(message)))
    if status == "built":
        return Built(connection(message))
    if op == "mount":
        return Done(number(message, "mnt_id"), connection(message), field(message, "options"))
    return Done(number(message, "mnt_id"))


def raise_outcome(message: dict[str, str]) -> None:
    """Raise the refusal or failure a helper's message reports, if it reports one."""
    status = message.get("status")
    if status == "refused":
        kind = field(message, "kind")
        raise policy.Refused(field(message, "message"),
                             kind if kind in policy.kinds() else "path")
    if status == "failed":
        raise HelperFailed(field(message, "message"))
    if status == "exited":
        raise HelperFailed("the broker's helper exited without an answer")


def field(fields: dict[str, str], name: str) -> str:
    """The field ``name`` of a report; ``HelperFailed`` naming it when it is missing."""
    try:
        return fields[name]
    except KeyError:
        status = fields.get("status", "")[:20]
        raise HelperFailed(f"the helper's {status!r} report has no {name} field") from None


def number(fields: dict[str, str], name: str) -> int:
    text = field(fields, name)
    if not UNSIGNED.fullmatch(text):
        raise HelperFailed(f"the helper sent a bad {name}: {text[:20]!r}")
    return int(text)


def _octal(fields: dict[str, str], name: str) -> str:
    text = field(fields, name)
    if not re.fullmatch(r"[0-7]{1,7}", text):
        raise HelperFailed(f"the helper sent a bad {name}: {text[:20]!r}")
    return text


def connection(fields: dict[str, str]) -> int:
    """The FUSE connection of a superblock device "0:N": its number in fusectl."""
    dev = field(fields, "dev")
    major, _, minor = dev.partition(":")
    if not (UNSIGNED.fullmatch(major) and UNSIGNED.fullmatch(minor)):
        raise HelperFailed(f"the helper sent a bad device {dev[:24]!r}")
    return int(minor)
