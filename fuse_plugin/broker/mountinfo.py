"""Reading /proc/PID/mountinfo (proc(5)): the broker's own, to know what Allocate's bind
of its directory looks like from inside a container.

A caller's table is read by the helper in the caller's namespace (native/helper.c),
never here: the broker only ever reads its own. The demo parses its containers' tables
with ``parse`` too (from the host, to find the FUSE connections to abort).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fuse_plugin.broker.policy import Mark


@dataclass(frozen=True)
class Entry:
    mount_id: int
    dev: str  # major:minor of the filesystem
    root: str  # the directory of that filesystem mounted here
    mountpoint: str
    fstype: str
    options: str = ""  # the mount's own (rw or ro, ...)
    super_options: str = ""  # the filesystem's (a cgroup v1 hierarchy's controllers)


def parse(text: str) -> list[Entry]:
    """Mountpoints and roots are relative to the reading process's root, with space,
    tab, newline and backslash escaped as octal."""
    entries = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 6:
            continue
        tail = right.split(" ")
        entries.append(Entry(mount_id=int(fields[0]), dev=fields[2],
                             root=unescape(fields[3]), mountpoint=unescape(fields[4]),
                             fstype=tail[0], options=fields[5],
                             super_options=tail[2] if len(tail) > 2 else ""))
    return entries


def unescape(text: str) -> str:
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


def mark_of(directory: Path, table: str | None = None) -> Mark:
    """How a bind of ``directory`` shows in any namespace's table: the device of its
    filesystem and its path from that filesystem's root (the mount it is on, plus the
    rest of the path)."""
    real = os.path.realpath(directory)
    if table is None:
        with open("/proc/self/mountinfo") as info:
            table = info.read()
    best: Entry | None = None
    for entry in parse(table):
        point = entry.mountpoint
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mountpoint)):
            best = entry
    if best is None:
        raise OSError(f"{real} is on no mount in /proc/self/mountinfo")
    rest = real[len(best.mountpoint.rstrip("/")):]
    root = (best.root.rstrip("/") + rest) or "/"
    return Mark(best.dev, root)
