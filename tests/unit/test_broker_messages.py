"""The loop <-> helper messages are declared once (``fuse_plugin/broker/messages.py``):
the loop encodes and decodes only through that declaration, and ``native/helper.c``,
which keeps its own lists to check what it hears, is read here and held to it in both
directions: what it sends at each ``say`` site is a declared report, and what each of its
``hear`` sites accepts and needs is what the loop may send there."""

from __future__ import annotations

import re

import pytest

from fuse_plugin.broker import frames, messages
from fuse_plugin.broker.messages import HelperFailed
from tests.lib import broker as broker_rig

HELPER_SOURCE = broker_rig.NATIVE / "helper.c"
MOUNT_FACTS = {"status": "facts", "mount": "41", "fstype": "ext4", "mount_point": "/mnt",
               "shared": "1", "mode": "1777", "owner": "0", "writable": "-", "uid": "0",
               "gid": "0"}


def code() -> str:
    """helper.c without its comments (which quote fields as prose)."""
    return re.sub(r"/\*.*?\*/", "", HELPER_SOURCE.read_text(), flags=re.DOTALL)


def arguments(call: str) -> list[str]:
    """A C call's arguments, split at the commas outside parentheses and strings."""
    parts, depth, current, quoted = [], 0, "", False
    for i, char in enumerate(call):
        if char == '"' and call[i - 1] != "\\":
            quoted = not quoted
        if not quoted and char in "()":
            depth += 1 if char == "(" else -1
        if char == "," and depth == 0 and not quoted:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def said() -> list[tuple[str | None, frozenset[str]]]:
    """Each say site's status (None: a variable, finish's refused or failed) and the
    fields it sends besides "status"."""
    sites = []
    text = code()
    calls = re.findall(r"(?<!void )\bsay\((.*?),\s*NULL\);", text, flags=re.DOTALL)
    assert len(calls) == len(re.findall(r"(?<!void )\bsay\(", text))  # each one read
    for call in calls:
        args = arguments(call)
        keys = args[0::2]
        assert all(re.fullmatch(r'"\w+"', key) for key in keys), f"say({call}): a key " \
            "that is not a literal cannot be checked"
        assert keys[0] == '"status"', f"say({call}) does not start with its status"
        status = args[1].strip('"') if args[1].startswith('"') else None
        sites.append((status, frozenset(key.strip('"') for key in keys[1:])))
    return sites


def fits(sent: frozenset[str], kind: type) -> bool:
    return messages.required(kind) <= sent <= set(messages.wires(kind))


def test_every_say_site_sends_a_declared_report() -> None:
    sites = said()
    assert len(sites) >= 8, sites  # the mark, two facts, built, two oks, the outcomes
    for status, sent in sites:
        if status is None:  # finish(status, ...): a refusal or a failure
            assert all(fits(sent, kind) for kind in messages.OUTCOMES), sent
            continue
        kinds = [k for k in messages.REPORTS if status == k.STATUS]
        assert kinds, f"helper.c says status {status!r}, which messages.py does not declare"
        assert any(fits(sent, kind) for kind in kinds), \
            f"helper.c's {status!r} report sends {sorted(sent)}, declared: " \
            f"{[sorted(messages.wires(k)) for k in kinds]}"


def test_every_declared_report_and_field_is_sent_by_the_helper() -> None:
    """No field the loop reads that C never sends (and no kind C never says)."""
    sites = said()
    for kind in messages.REPORTS:
        sent = [fields for status, fields in sites
                if (status == kind.STATUS or (status is None and kind in messages.OUTCOMES))
                and fits(fields, kind)]
        assert sent, f"helper.c never says a {kind.__name__}"
        assert set(messages.wires(kind)) == set().union(*sent), kind.__name__


def heard() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """helper.c's lists of what it hears: macro -> (the fields allowed, those needed)."""
    found = re.findall(r'^#define (REQUEST_FIELDS|ANSWER_TO_\w+) "([\w ]*)", "([\w ]*)"$',
                       code(), flags=re.MULTILINE)
    return {name: (frozenset(allowed.split()), frozenset(needed.split()))
            for name, allowed, needed in found}


def expected() -> dict[str, tuple[type, ...]]:
    """Each of helper.c's lists, and the messages the loop may send it there."""
    named = {re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).upper(): answers
             for kind, answers in messages.ANSWERS.items()}
    return {"REQUEST_FIELDS": (messages.Request,),
            **{f"ANSWER_TO_{name}": answers for name, answers in named.items()}}


def test_each_hear_list_is_what_the_loop_may_send_there() -> None:
    lists, want = heard(), expected()
    assert set(lists) == set(want)
    for name, kinds in want.items():
        allowed = frozenset().union(*(messages.wires(kind) for kind in kinds))
        needed = frozenset.intersection(*(messages.required(kind) for kind in kinds))
        assert lists[name] == (allowed, needed), name


def test_every_hear_site_checks_against_a_declared_list() -> None:
    calls = re.findall(r"\bhear\(buf, (\w+), (.*?), &\w+\);", code())
    assert sorted(name for _, name in calls) == sorted(expected())
    for frame, name in calls:
        assert frame == ("REQUEST" if name == "REQUEST_FIELDS" else "ANSWER"), name


def test_the_loops_answers_are_encoded_from_their_declaration() -> None:
    def fields(answer: messages.Answer) -> dict[str, str]:
        return frames.decode(messages.encode(answer), frames.ANSWER)

    assert fields(messages.STOP) == {"go": "0"}
    assert fields(messages.UnmountVerdict(lazy=True)) == {"lazy": "1", "go": "1"}
    assert fields(messages.MountVerdict("s", "t", "", "allow_other", "ro")) == {
        "source": "s", "subtype": "t", "max_read": "", "flags": "allow_other",
        "attrs": "ro", "go": "1"}


def test_a_request_leaves_out_only_an_optional_field() -> None:
    unmount = messages.Request("unmount", "/mnt", 1000, 1000, (5, 6))
    data = messages.encode(unmount)
    assert b"fuse_fd" not in data
    assert b"groups" in data
    assert b"fuse_fd" in messages.encode(messages.Request("mount", "/m", 0, 0, (), 3))


def test_a_report_is_decoded_into_its_types() -> None:
    facts = messages.decode(MOUNT_FACTS, messages.MountFacts)
    assert facts == messages.MountFacts(41, "ext4", "/mnt", True, 0o1777, 0, None, 0, 0)


@pytest.mark.parametrize(("change", "words"), [
    ({"super": "rw"}, "unknown field 'super'"),  # what the helper no longer sends
    ({"writable": "yes"}, "bad writable"),
    ({"shared": ""}, "bad shared"),
    ({"mode": "8"}, "bad mode"),
    ({"owner": "+1"}, "bad owner"),
    ({"mount": "{0}"}, r"bad mount: '\{0\}'"),  # shown as sent
])
def test_a_report_with_an_unknown_or_bad_field_is_refused_naming_it(
        change: dict[str, str], words: str) -> None:
    with pytest.raises(HelperFailed, match=words):
        messages.decode(MOUNT_FACTS | change, messages.MountFacts)


def test_a_missing_optional_field_is_none_and_a_missing_required_one_refuses() -> None:
    assert messages.decode({"status": "failed", "message": "no"}, messages.Failure) == \
        messages.Failure("no")
    with pytest.raises(HelperFailed, match="'failed' report has no message field"):
        messages.decode({"status": "failed", "kind": "path"}, messages.Failure)
