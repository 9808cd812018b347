"""What the shim and the broker say to each other, and where containers find them.

One ``SOCK_SEQPACKET`` message per request and per reply. Each message is a run of
NUL-terminated ``key=value`` fields, which is trivial to write and read in C and cannot be
ambiguous: paths and options never contain NUL. A mount reply carries the FUSE fd in
``SCM_RIGHTS``. The C side is ``shim/fusermount3.c``; a unit test keeps its constants equal
to these.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VERSION = "1"
MAX_MESSAGE = 16384
SOCKET_NAME = "broker.sock"
SHIM_NAME = "fusermount3"
# Inside a container: the broker's host directory is bound here, read-only.
CONTAINER_DIR = "/run/fuse-broker"
CONTAINER_SOCKET = f"{CONTAINER_DIR}/{SOCKET_NAME}"
SOCKET_ENV = "FUSE_BROKER_SOCKET"
# Where libfuse 3, libfuse 2 and the Go FUSE libraries exec the helper (docs/broker.md).
SHIM_TARGETS = ("/usr/bin/fusermount3", "/usr/bin/fusermount",
                "/bin/fusermount3", "/bin/fusermount")

OPS = ("mount", "unmount")
FLAGS = ("lazy", "auto")
_FIELDS = ("v", "op", "path", "options", "flags", "mount_id")


class BadRequest(ValueError):
    """The message is not a request this broker understands (said in the reply)."""


@dataclass(frozen=True)
class Request:
    op: str
    path: str
    options: str = ""
    flags: frozenset[str] = frozenset()
    mount_id: int | None = None


def container_mounts(broker_dir: Path) -> list[tuple[str, str]]:
    """(container path, host path) of every read-only bind Allocate adds in broker mode:
    the socket's directory (so a restarted broker's new socket is seen) and the shim at
    each place a FUSE library looks for fusermount."""
    shim = str(broker_dir / SHIM_NAME)
    return [(CONTAINER_DIR, str(broker_dir)), *((target, shim) for target in SHIM_TARGETS)]


def encode(**fields: str) -> bytes:
    return b"".join(f"{key}={value}".encode() + b"\0" for key, value in fields.items())


def decode(data: bytes) -> dict[str, str]:
    if not data or len(data) > MAX_MESSAGE or not data.endswith(b"\0"):
        raise BadRequest("malformed message: expected NUL-terminated key=value fields")
    fields: dict[str, str] = {}
    for raw in data[:-1].split(b"\0"):
        key, sep, value = raw.partition(b"=")
        try:
            name, text = key.decode("ascii"), value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("malformed message: fields must be UTF-8") from None
        if not sep or not name:
            raise BadRequest(f"malformed field {raw[:40]!r}: expected key=value")
        if name in fields:
            raise BadRequest(f"field {name!r} given twice")
        fields[name] = text
    return fields


def parse_request(data: bytes) -> Request:
    fields = decode(data)
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise BadRequest(f"unknown request field(s): {', '.join(unknown)}")
    if fields.get("v") != VERSION:
        raise BadRequest(f"protocol version {fields.get('v')!r} is not {VERSION!r}: "
                         "the shim and the broker come from different releases")
    op = fields.get("op", "")
    if op not in OPS:
        raise BadRequest(f"unknown op {op!r}: expected mount or unmount")
    if "path" not in fields:
        raise BadRequest("the request names no path")
    flags = frozenset(f for f in fields.get("flags", "").split(",") if f)
    if flags - set(FLAGS):
        raise BadRequest(f"unknown flag(s): {', '.join(sorted(flags - set(FLAGS)))}")
    if op == "mount" and flags:
        raise BadRequest("flags apply to unmount only")
    mount_id = fields.get("mount_id")
    if mount_id is not None and not mount_id.isdigit():
        raise BadRequest(f"mount_id must be a number, got {mount_id!r}")
    return Request(op=op, path=fields["path"], options=fields.get("options", ""),
                   flags=flags, mount_id=int(mount_id) if mount_id is not None else None)
