"""The broker's conversation with its helper (``native/helper.c``): framed, typed messages.

Why framed: a request carries the caller's supplementary groups (the kernel allows
65,536), so no fixed buffer is sure to hold it, and a datagram read into a buffer too small
for it is cut silently: the fields after the cut would be lost, not refused. So every
message states its own length, the receiver reads it with ``MSG_TRUNC`` (so a datagram
longer than its buffer is seen, not cut) and refuses one whose length or layout is
wrong, and a message too large to send is refused whole by its sender. What keeps a lost
field from weakening a check is that the helper's checks as the caller and its refusal
to walk into FUSE are not fields at all: they are unconditional in the helper.

A frame, in the host's byte order (both ends run on one machine)::

    "FBH1" | u32 frame length | u8 type | u8 field count | u16 zero
    each field: u8 key length | key | NUL | u32 value length | value | NUL

A value is text (UTF-8, no NUL) except ``groups``, an array of u32. A repeated field
refuses the whole message on either side. Which fields make which message is
``messages``' declaration: ``native/helper.c`` checks each request and answer against
its copy of it (an unknown field, or a missing one it needs, refuses it), and the broker
refuses a report with a field missing or unknown (``messages.decode``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

MAGIC = b"FBH1"
MAX_FRAME = 163840  # 32,768 groups of 4 bytes, a 4 KiB path, and room for the rest
MAX_GROUPS = 32768  # a caller with more is refused whole, never checked with fewer
MAX_FIELDS = 16
REQUEST, ANSWER, REPORT = 1, 2, 3  # loop to helper; loop to helper; helper to loop
_HEAD = struct.Struct("=4sIBBH")
_KEY = struct.Struct("=B")
_LEN = struct.Struct("=I")
BINARY = frozenset({"groups"})


class FrameError(ValueError):
    """A frame that is too large to send, or that is not a well-formed frame."""


def encode(kind: int, fields: Mapping[str, str | int | Sequence[int]]) -> bytes:
    """One frame; ``FrameError`` if it would be larger than ``MAX_FRAME`` (the caller
    refuses the request whole rather than send less)."""
    if len(fields) > MAX_FIELDS:
        raise FrameError(f"{len(fields)} fields, more than {MAX_FIELDS}")
    body = bytearray()
    for key, value in fields.items():
        name = key.encode("ascii")
        data = _value_bytes(key, value)
        body += _KEY.pack(len(name)) + name + b"\0" + _LEN.pack(len(data)) + data + b"\0"
    size = _HEAD.size + len(body)
    if size > MAX_FRAME:
        raise FrameError(f"a message of {size} bytes, more than the {MAX_FRAME} the "
                         "helper reads")
    return _HEAD.pack(MAGIC, size, kind, len(fields), 0) + bytes(body)


def _value_bytes(key: str, value: str | int | Sequence[int]) -> bytes:
    if key in BINARY:
        assert not isinstance(value, (str, int)), f"{key} is an array of numbers"
        if len(value) > MAX_GROUPS:
            raise FrameError(f"{len(value)} {key}, more than {MAX_GROUPS}")
        return struct.pack(f"={len(value)}I", *value)
    data = str(value).encode()
    if b"\0" in data:
        raise FrameError(f"{key} holds a NUL byte")
    return data


def decode(data: bytes, kind: int) -> dict[str, str]:
    """The text fields of one frame of type ``kind``; ``FrameError`` when its length,
    type or layout is not exactly right."""
    if len(data) < _HEAD.size:
        raise FrameError(f"a message of {len(data)} bytes is shorter than a frame header")
    magic, size, got, count, zero = _HEAD.unpack_from(data)
    if magic != MAGIC or zero != 0:
        raise FrameError("not a frame (bad magic)")
    if size != len(data):
        raise FrameError(f"the frame says {size} bytes, {len(data)} arrived")
    if got != kind:
        raise FrameError(f"a frame of type {got}, expected {kind}")
    fields: dict[str, str] = {}
    at = _HEAD.size
    for _ in range(count):
        key, at = _take(data, at, _KEY)
        value, at = _take(data, at, _LEN)
        name = key.decode("ascii", errors="replace")
        if name in fields:
            raise FrameError(f"field {name!r} given twice")
        if b"\0" in value:
            raise FrameError(f"field {name!r} holds a NUL byte")
        try:
            fields[name] = value.decode()
        except UnicodeDecodeError:
            raise FrameError(f"field {name!r} is not UTF-8") from None
    if at != len(data):
        raise FrameError(f"{len(data) - at} bytes after the last field")
    return fields


def _take(data: bytes, at: int, length: struct.Struct) -> tuple[bytes, int]:
    """One length-prefixed, NUL-terminated item at ``at``; the item and where the next
    one starts."""
    if at + length.size > len(data):
        raise FrameError("a field runs past the end of the frame")
    (size,) = length.unpack_from(data, at)
    start = at + length.size
    end = start + size
    if end + 1 > len(data) or data[end] != 0:
        raise FrameError("a field runs past the end of the frame")
    return data[start:end], end + 1
