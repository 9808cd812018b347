"""What the helper's (``native/helper.c``) reports mean to the loop, each in its turn.

``messages`` declares every report's fields and decodes them; this module takes them in
the one order a request's steps come (``messages.STEPS``):

    mount:    mark -> facts -> built -> ok
    unmount:  mark -> facts -> ok

and says what each means in ``policy``'s terms. A report of another step fails the
request (``HelperFailed``): the loop never acts on a message that arrived out of turn,
so a helper that said ``ok`` before ``facts`` (whatever made it) mounts nothing
unjudged. A refusal or a failure the helper reports is raised as ``policy.Refused`` or
``HelperFailed`` at any step, and a helper that exited (``messages.Exited``) fails the
request. A report with a field missing, unknown or that does not parse fails it too
(``messages.decode``): a helper that is not ours, never a value to guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuse_plugin.broker import messages, policy
from fuse_plugin.broker.messages import HelperFailed

__all__ = ["STEPS", "Built", "Done", "HelperFailed", "Marked", "MountFacts", "Report",
           "UnmountFacts", "read"]
STEPS = {op: tuple(kind.STATUS for kind in kinds) for op, kinds in messages.STEPS.items()}


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


def read(message: messages.Heard, op: str, step: int) -> Report:
    """The helper's ``step``-th report (from 0) for ``op``: ``policy.Refused`` or
    ``HelperFailed`` if it refuses or fails, ``HelperFailed`` if it is not the report
    this step expects or does not parse, or if the helper exited or said no frame."""
    if isinstance(message, messages.Exited):
        raise HelperFailed("the broker's helper exited without an answer")
    if isinstance(message, messages.Nonsense):
        raise HelperFailed(f"the helper said nonsense ({message.why})")
    status = message.get("status", "")
    outcome = next((kind for kind in messages.OUTCOMES if status == kind.STATUS), None)
    if outcome is not None:
        raise_outcome(messages.decode(message, outcome))
    kinds = messages.STEPS[op]
    kind = kinds[step] if step < len(kinds) else None
    expected = kind.STATUS if kind is not None else "nothing more"
    if kind is None or status != expected:
        if "status" not in message:
            raise HelperFailed("the helper's report has no status field")
        raise HelperFailed(f"the helper said {status[:20]!r} where {expected!r} comes")
    return _meaning(messages.decode(message, kind))


def _meaning(report: messages.Report) -> Report:
    """What a step's report means to the loop, in policy's terms."""
    match report:
        case messages.Mark(mark_dev, mark_root):
            return Marked(policy.Mark(mark_dev, mark_root))
        case messages.MountFacts():
            return MountFacts(policy.Target(
                mount_id=report.mount, fstype=report.fstype, mount_point=report.mount_point,
                shared=report.shared, mode=report.mode, owner=report.owner,
                writable=report.writable, uid=report.uid, gid=report.gid))
        case messages.UnmountFacts(mount, fstype, dev):
            return UnmountFacts(policy.Existing(mount_id=mount, fstype=fstype, connection=dev))
        case messages.Built(dev):
            return Built(dev)
        case messages.Mounted(mnt_id, dev, options):
            return Done(mnt_id, dev, options)
        case messages.Unmounted(mnt_id):
            return Done(mnt_id)
    raise AssertionError(f"{type(report).__name__} is no step")  # outcomes are raised


def raise_outcome(outcome: messages.Report) -> None:
    """Raise the refusal or failure a helper reports."""
    if isinstance(outcome, messages.Refusal):
        kind = outcome.kind if outcome.kind in policy.kinds() else "path"
        raise policy.Refused(outcome.message, kind)
    if isinstance(outcome, messages.Failure):
        raise HelperFailed(outcome.message)
