"""The loop-to-helper frames (fuse_plugin/broker/frames.py) and the helper's copy of their
constants and of the FUSE rule (native/helper.c)."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence

import pytest

from fuse_plugin.broker import frames, messages, policy, protocol
from tests.lib import broker as broker_rig

HELPER_SOURCE = broker_rig.NATIVE / "helper.c"


def test_the_helper_and_the_codec_agree_on_constants() -> None:
    source = HELPER_SOURCE.read_text() + (broker_rig.NATIVE / "mounts.h").read_text()
    defines = dict(re.findall(r'^#define (\w+) "?([^"\n]*)"?$', source, re.MULTILINE))
    assert int(defines["MAX_FRAME"]) == frames.MAX_FRAME
    assert int(defines["MAX_GROUPS"]) == frames.MAX_GROUPS
    assert int(defines["MAX_FIELDS"]) == frames.MAX_FIELDS
    assert defines["FRAME_MAGIC"].encode() == frames.MAGIC
    assert (int(defines["REQUEST"]), int(defines["ANSWER"]), int(defines["REPORT"])) == (
        frames.REQUEST, frames.ANSWER, frames.REPORT)
    assert tuple(defines["NO_WALK"].split(",")) == policy.NO_WALK
    assert defines["BROKER_DIR"] == protocol.CONTAINER_DIR


def test_no_request_field_can_switch_a_check_off() -> None:
    """The request has no field for "check" or "nowalk" (and helper.c's request schema
    is the declaration's: test_broker_messages)."""
    assert set(messages.wires(messages.Request)) == {"op", "path", "uid", "gid", "groups",
                                                     "fuse_fd"}


def test_a_frame_round_trips_and_states_its_length() -> None:
    data = frames.encode(frames.REPORT, {"status": "ok", "mnt_id": 7})
    assert struct.unpack_from("=I", data, 4)[0] == len(data)
    assert frames.decode(data, frames.REPORT) == {"status": "ok", "mnt_id": "7"}


def test_all_groups_fit_up_to_the_limit_and_more_are_refused_whole() -> None:
    fields: dict[str, str | int | Sequence[int]] = {
        "op": "mount", "path": "/" + "x" * 4094, "uid": 1000, "gid": 1000, "fuse_fd": 5}
    data = frames.encode(frames.REQUEST, {**fields,
                                          "groups": tuple(range(frames.MAX_GROUPS))})
    assert len(data) <= frames.MAX_FRAME
    with pytest.raises(frames.FrameError, match="more than 32768"):
        frames.encode(frames.REQUEST, {**fields,
                                       "groups": tuple(range(frames.MAX_GROUPS + 1))})


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d[:-1], "says 21 bytes, 20 arrived"),
    (lambda d: d + b"\0", "says 21 bytes, 22 arrived"),
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: d[:8] + b"\x01" + d[9:], "type 1, expected 3"),
    (lambda d: d[:6], "shorter than a frame header"),
])
def test_a_wrong_frame_is_refused_with_a_reason(change: Callable[[bytes], bytes],
                                                words: str) -> None:
    data = frames.encode(frames.REPORT, {"s": "o"})
    assert len(data) == 21
    with pytest.raises(frames.FrameError, match=words):
        frames.decode(change(data), frames.REPORT)


def test_text_with_a_nul_is_never_sent() -> None:
    with pytest.raises(frames.FrameError, match="NUL"):
        frames.encode(frames.REQUEST, {"path": "/a\0b"})
