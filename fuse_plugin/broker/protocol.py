"""What the shim and the broker say to each other, and where containers find them.

One ``SOCK_SEQPACKET`` message per request and per reply. Each message is a run of
NUL-terminated ``key=value`` fields, which is trivial to write and read in C and cannot be
ambiguous: paths and options never contain NUL. Nothing but text crosses the socket: a
mount request names the number of the /dev/fuse fd the shim opened (``fuse_fd``), and
the broker's helper takes that fd from the caller with ``pidfd_getfd``; the socket
refuses descriptors (``SO_PASSRIGHTS``). The C side of the wire is
``native/fusermount3.c``; a unit test keeps its constants equal to these. A reply is
``status`` (``ok`` or ``error``), then ``message``, ``mount_id`` or ``retry``. (The
broker talks to its helper in ``frames``, not in this codec.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VERSION = "2"
MAX_MESSAGE = 16384
SOCKET_NAME = "broker.sock"
SHIM_NAME = "fusermount3"
# Inside a container: the broker's host directory is bound here, read-only.
CONTAINER_DIR = "/run/fuse-broker"
CONTAINER_SOCKET = f"{CONTAINER_DIR}/{SOCKET_NAME}"
SOCKET_ENV = "FUSE_BROKER_SOCKET"
# In a reply (``retry=1``, with status=error): the broker is stopping (SIGTERM) and did
# nothing of the request, so the shim asks again, of the broker that replaces it, within
# its wait (WAIT_ENV), as when the connection was reset unread. Replies may carry fields
# an older shim does not know (it ignores them): no new protocol version.
RETRY_FIELD = "retry"
# In the caller's environment: how many seconds the shim waits for a broker that is
# restarting (its socket missing while the directory is there, or stale); the default is
# WAIT_SECONDS in the C source.
WAIT_ENV = "FUSE_BROKER_WAIT"
# Where FUSE programs exec their helper (docs/broker.md has the survey): libfuse 3 and 2
# and the Go FUSE libraries; and mergerfs, whose bundled libfuse looks for a helper of
# its own name first (its package ships a real, unprivileged one in /usr/bin, which
# PATH finds before any fusermount). A missing target is created by the runtime.
SHIM_TARGETS = ("/usr/bin/fusermount3", "/usr/bin/fusermount",
                "/bin/fusermount3", "/bin/fusermount", "/usr/bin/mergerfs-fusermount")

# ASCII digits and nothing else, any number of them: int() also takes " 5", "+5" and
# other scripts' digits, which a field of the protocol must not be.
ASCII_DIGITS = re.compile(r"[0-9]+")
OPS = ("mount", "unmount")
FLAGS = ("lazy", "auto")
_FIELDS = ("v", "op", "path", "options", "fuse_fd", "flags", "mount_id")


class BadRequest(ValueError):
    """The message is not a request this broker understands (said in the reply)."""


@dataclass(frozen=True)
class Request:
    op: str
    path: str
    options: str = ""
    flags: frozenset[str] = frozenset()
    mount_id: int | None = None
    fuse_fd: int = -1


def encode(**fields: object) -> bytes:
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
    mount_id = _number(fields, "mount_id")
    fuse_fd = _number(fields, "fuse_fd")
    if op == "mount" and fuse_fd is None:
        raise BadRequest("a mount request must name the caller's /dev/fuse fd (fuse_fd=)")
    if op == "unmount" and fuse_fd is not None:
        raise BadRequest("fuse_fd applies to mount only")
    return Request(op=op, path=fields["path"], options=fields.get("options", ""),
                   flags=flags, mount_id=mount_id,
                   fuse_fd=fuse_fd if fuse_fd is not None else -1)


def _number(fields: dict[str, str], name: str) -> int | None:
    """A field that must be a whole number in ASCII digits (not ' 5', '+5' or '١٢')."""
    text = fields.get(name)
    if text is None:
        return None
    if not ASCII_DIGITS.fullmatch(text) or len(text) > 10:
        raise BadRequest(f"{name} must be a number, got {text[:20]!r}")
    return int(text)
