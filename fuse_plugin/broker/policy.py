"""The broker's own rules, on top of what fusermount3 and the kernel check.

Pure functions over strings and mount tables, so every rule is tested without a mount.
A refusal is a ``Refused`` whose message goes back to the caller (the shim prints it as
``fusermount3: <message>``) and into the broker's log line.

Why each rule exists:
- fusermount3 run as root checks nothing and honours ``suid``, ``dev`` and ``blkdev``;
  the broker runs it as root, so those are refused here and ``nosuid,nodev`` is forced.
- The path is checked as a string here (absolute, no ``.``/``..``, not ``/``, not in
  the kernel's or the image's system trees, ``DENIED_TREES``) and resolved in the
  caller's root without symlinks by the caller module.
- A mountpoint inside another FUSE mount is refused so that resolving it never calls
  into a filesystem that a container's daemon could stall.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_PATH = 4095
# The kernel silently truncates mount data at a page; leave room for what
# fusermount3 adds (fd=,rootmode=,user_id=,group_id=).
MAX_OPTIONS = 3072
MAX_VALUE = 1024
# The kernel's trees (as in the AppArmor presets), the image's system trees, and where
# Allocate puts the broker: a FUSE filesystem belongs on a data path (/mnt, /data, /var,
# /home, /srv, /opt, /tmp, ...), and a FUSE daemon answering for /etc or /usr could feed
# any process that reads the container's files, the node's own tools included.
DENIED_TREES = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32",
                "/lib64", "/libx32", "/boot", "/run/fuse-broker")
FLAG_OPTIONS = frozenset(("rw", "ro", "nosuid", "nodev", "exec", "noexec", "async", "sync",
                          "atime", "noatime", "dirsync"))
WORD_OPTIONS = frozenset(("default_permissions", "allow_other", "nonempty"))
ESCAPED_VALUES = ("fsname", "subtype")  # fusermount3 honours backslash escapes in these
FORCED = "nosuid,nodev"
_REASONS = {
    "suid": "broker mounts are always nosuid,nodev",
    "dev": "broker mounts are always nosuid,nodev",
    "blkdev": "fuseblk (block-device FUSE) is not a type the broker mounts",
    "blksize": "fuseblk (block-device FUSE) is not a type the broker mounts",
    "auto_unmount": "auto_unmount is handled by the fusermount3 shim, not the broker",
    "fd": "the broker sets fd=, rootmode=, user_id= and group_id= itself",
    "rootmode": "the broker sets fd=, rootmode=, user_id= and group_id= itself",
    "user_id": "the broker sets fd=, rootmode=, user_id= and group_id= itself",
    "group_id": "the broker sets fd=, rootmode=, user_id= and group_id= itself",
}


class Refused(Exception):
    """A request the broker will not carry out; the message says why, in one line."""


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/PID/mountinfo, the parts the broker reads."""

    mount_id: int
    mountpoint: str
    fstype: str
    shared: bool


def is_fuse(fstype: str) -> bool:
    return fstype == "fuse" or fstype.startswith("fuse.")


def caller(uid: int) -> None:
    if uid != 0:
        raise Refused(f"the broker mounts only for root in a pod without user namespaces "
                      f"(the caller is uid {uid} on the node); see docs/broker.md")


def split_options(text: str) -> list[str]:
    """Split at commas exactly as fusermount3 does: a backslash escapes the next
    character only inside fsname= and subtype= values."""
    options: list[str] = []
    i = 0
    while i < len(text):
        escaped = text.startswith(tuple(f"{name}=" for name in ESCAPED_VALUES), i)
        j = i
        while j < len(text) and text[j] != ",":
            j += 2 if escaped and text[j] == "\\" and j + 1 < len(text) else 1
        options.append(text[i:j])
        i = j + 1
    return options


def options(text: str) -> str:
    """The options to hand fusermount3: the request's, each allowed, then nosuid,nodev."""
    if len(text) > MAX_OPTIONS:
        raise Refused(f"mount options longer than {MAX_OPTIONS} characters")
    kept = []
    for option in split_options(text):
        if not option:
            continue
        name, sep, value = option.partition("=")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in option):
            raise Refused(f"control character in mount option {name!r}")
        if name in _REASONS:
            raise Refused(f"mount option {name!r} refused: {_REASONS[name]}")
        if sep and name in ESCAPED_VALUES:
            if not value or len(value) > MAX_VALUE:
                raise Refused(f"mount option {name}= needs a value of 1 to "
                              f"{MAX_VALUE} characters")
        elif sep and name == "max_read":
            if not value.isdigit() or int(value) > 1 << 31:
                raise Refused(f"max_read must be a number, got {value!r}")
        elif sep or name not in FLAG_OPTIONS | WORD_OPTIONS:
            raise Refused(f"unknown mount option {option[:64]!r}")
        kept.append(option)
    return ",".join([*kept, FORCED])


def path(text: str) -> str:
    """A canonical absolute path the broker may resolve in the caller's root."""
    if not text.startswith("/") or len(text) > MAX_PATH:
        raise Refused(f"mountpoint must be an absolute path of at most {MAX_PATH} "
                      f"characters, got {text[:80]!r}")
    parts = text.split("/")[1:]
    if text == "/" or any(p in ("", ".", "..") for p in parts):
        raise Refused(f"mountpoint {text!r} is not a canonical path below / "
                      "(no empty, '.' or '..' components)")
    for tree in DENIED_TREES:
        if text == tree or text.startswith(tree + "/"):
            raise Refused(f"mountpoint {text!r} is under {tree}: the broker does not "
                          "mount there")
    return text


def parent_and_name(text: str) -> tuple[str, str]:
    parent, _, name = text.rpartition("/")
    return parent or "/", name


def inside_fuse(text: str, mounts: Iterable[MountEntry]) -> None:
    """Refuse a path at or inside a FUSE mount: resolving below it would call its daemon,
    and a second FUSE mount on the same directory is a mistake."""
    for entry in mounts:
        point = entry.mountpoint
        if is_fuse(entry.fstype) and (point in (text, "/") or text.startswith(point + "/")):
            raise Refused(f"{text!r} is at or inside the FUSE mount {point!r}: the broker "
                          "does not resolve paths through FUSE filesystems")


def room_for_another(mounts: Iterable[MountEntry], limit: int) -> None:
    count = sum(1 for entry in mounts if is_fuse(entry.fstype))
    if count >= limit:
        raise Refused(f"the container already has {count} FUSE mounts, the broker's limit "
                      f"(--max-mounts {limit})")


def fuse_mount_at(text: str, mounts: Iterable[MountEntry]) -> MountEntry:
    """The topmost mount at ``text``, which must be FUSE (unmount never touches others:
    the runtime's masks over /proc files are mounts too)."""
    top = None
    for entry in mounts:
        if entry.mountpoint == text:
            top = entry
    if top is None or not is_fuse(top.fstype):
        raise Refused(f"{text!r} is not a FUSE mount" +
                      (f" (it is {top.fstype})" if top else ""))
    return top


def mountinfo(text: str) -> list[MountEntry]:
    """Parse /proc/PID/mountinfo (proc(5)); mountpoints are relative to that process's
    root and have space, tab, newline and backslash escaped as octal."""
    entries = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 6:
            continue
        entries.append(MountEntry(
            mount_id=int(fields[0]), mountpoint=_unescape(fields[4]),
            fstype=right.split(" ", 1)[0],
            shared=any(f.startswith("shared:") for f in fields[6:])))
    return entries


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        chunk = text[i + 1:i + 4]
        if text[i] == "\\" and len(chunk) == 3 and all(c in "01234567" for c in chunk):
            out.append(chr(int(chunk, 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
