"""The helper's reports are read in one place, into types, each in its turn: a report out
of turn or with a number that does not parse fails the request, so the loop never acts
on a message it did not expect (an ``ok`` before ``facts`` would have been taken)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import pytest

from fuse_plugin.broker import messages, policy, reports
from fuse_plugin.broker.reports import HelperFailed

MARK = {"status": "mark", "mark_dev": "254:1", "mark_root": "/b"}
MOUNT_FACTS = {"status": "facts", "mount": "41", "fstype": "ext4", "mount_point": "/mnt",
               "shared": "0", "mode": "755", "owner": "1000",
               "writable": "1", "uid": "1000", "gid": "1000"}
UNMOUNT_FACTS = {"status": "facts", "mount": "77", "fstype": "fuse.sshfs", "dev": "0:63"}
BUILT = {"status": "built", "dev": "0:63"}
MOUNTED = {"status": "ok", "mnt_id": "77", "dev": "0:63", "options": "rw,nosuid,nodev"}


def test_a_mount_reads_as_its_four_steps_in_order() -> None:
    got = [reports.read(m, "mount", n) for n, m in
           enumerate((MARK, MOUNT_FACTS, BUILT, MOUNTED))]
    assert got[0] == reports.Marked(policy.Mark("254:1", "/b"))
    assert isinstance(got[1], reports.MountFacts)
    assert (got[1].target.mode, got[1].target.owner, got[1].target.writable) == \
        (0o755, 1000, True)
    assert got[2] == reports.Built(63)
    assert got[3] == reports.Done(77, 63, "rw,nosuid,nodev")


def test_an_unmount_has_no_built_step() -> None:
    got = [reports.read(m, "unmount", n) for n, m in
           enumerate((MARK, UNMOUNT_FACTS, {"status": "ok", "mnt_id": "77"}))]
    assert got[1] == reports.UnmountFacts(policy.Existing(77, "fuse.sshfs", 63))
    assert got[2] == reports.Done(77)
    with pytest.raises(HelperFailed, match="'built' where 'ok' comes"):
        reports.read(BUILT, "unmount", 2)


@pytest.mark.parametrize(("message", "step", "words"), [
    (MOUNTED, 1, "'ok' where 'facts' comes"),  # done before it was judged
    (MOUNTED, 0, "'ok' where 'mark' comes"),
    (MOUNT_FACTS, 0, "'facts' where 'mark' comes"),
    (BUILT, 1, "'built' where 'facts' comes"),  # built before it was judged
    (MARK, 2, "'mark' where 'built' comes"),
    (MOUNTED, 4, "where 'nothing more' comes"),
    ({"status": "hello"}, 0, "'hello' where 'mark' comes"),
])
def test_a_report_out_of_turn_fails_the_request(message: dict[str, str], step: int,
                                                words: str) -> None:
    with pytest.raises(HelperFailed, match=words):
        reports.read(message, "mount", step)


@pytest.mark.parametrize(("field", "value"), [
    ("mount", "-1"), ("mount", "4x"), ("mount", "\u0661\u0662"), ("owner", ""),
    ("mode", "9"), ("mode", "0o755"), ("uid", "1" * 21),
])
def test_a_number_that_does_not_parse_fails(field: str, value: str) -> None:
    with pytest.raises(HelperFailed, match=f"bad {field}"):
        reports.read(MOUNT_FACTS | {field: value}, "mount", 1)


@pytest.mark.parametrize("dev", ["", "63", "0:x", "0:\u0661", "0:63:1"])
def test_a_connection_comes_from_the_superblocks_device(dev: str) -> None:
    assert reports.read(BUILT, "mount", 2) == reports.Built(63)
    with pytest.raises(HelperFailed, match="bad dev: "):
        reports.read(BUILT | {"dev": dev}, "mount", 2)


# What each step reads, and so what ``native/helper.c`` sends at each of its say sites.
READ = [
    (MARK, "mount", 0, ("status", "mark_dev", "mark_root")),
    (MOUNT_FACTS, "mount", 1, ("mount", "fstype", "mount_point", "shared", "mode", "owner",
                               "writable", "uid", "gid")),
    (BUILT, "mount", 2, ("dev",)),
    (MOUNTED, "mount", 3, ("mnt_id", "dev", "options")),
    (UNMOUNT_FACTS, "unmount", 1, ("mount", "fstype", "dev")),
    ({"status": "ok", "mnt_id": "77"}, "unmount", 2, ("mnt_id",)),
    ({"status": "refused", "message": "no", "kind": "path"}, "mount", 1, ("message", "kind")),
    ({"status": "failed", "message": "no"}, "mount", 1, ("message",)),
]


@pytest.mark.parametrize(("message", "op", "step", "name"), [
    (message, op, step, name) for message, op, step, names in READ for name in names])
def test_a_report_without_a_field_its_step_reads_fails_naming_it(
        message: dict[str, str], op: str, step: int, name: str) -> None:
    """A missing field is never read as "" (an empty fstype or mark would be judged as
    one): the request fails, and the reason names the field."""
    whole: AbstractContextManager[object] = nullcontext()
    if message["status"] in ("refused", "failed"):  # whole, the helper's own outcome
        whole = pytest.raises((policy.Refused, HelperFailed), match=r"^no$")
    with whole:
        reports.read(message, op, step)
    cut = {k: v for k, v in message.items() if k != name}
    with pytest.raises(HelperFailed, match=f"report has no {name} field"):
        reports.read(cut, op, step)


def test_refusals_and_failures_are_raised_at_any_step() -> None:
    refused = {"status": "refused", "message": "no", "kind": "permission"}
    for step in range(4):
        with pytest.raises(policy.Refused) as caught:
            reports.read(refused, "mount", step)
        assert caught.value.kind == "permission"
    with pytest.raises(policy.Refused) as unknown:  # a kind the metrics do not know
        reports.read(refused | {"kind": "bogus"}, "mount", 0)
    assert unknown.value.kind == "path"
    with pytest.raises(HelperFailed, match="kernel said no"):
        reports.read({"status": "failed", "message": "kernel said no"}, "unmount", 1)
    with pytest.raises(HelperFailed, match="exited without an answer"):
        reports.read(messages.Exited(), "mount", 3)
    with pytest.raises(HelperFailed, match=r"said nonsense \(bad magic\)"):
        reports.read(messages.Nonsense("bad magic"), "mount", 0)
