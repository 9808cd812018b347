"""Every rule the broker applies, as pure functions over the request and the kernel's facts.

A refusal is a ``Refused`` whose message goes back to the caller (the shim prints it as
``fusermount3: <message>``) and into the broker's log line; its ``kind`` names the rule
for the metrics. Nothing here does I/O: the facts come from ``caller`` (the kernel's view
of the process) and from the helper (``native/helper.c``), which resolves the path in
the caller's namespace and reports what it reached.

Why the rules are what they are:
- The broker builds the mount itself (fsopen/fsconfig/fsmount), so the options are read
  once, here, and handed to the kernel as separate parameters: no string is ever joined
  again for another parser to read differently. ``suid``, ``dev`` and ``blkdev`` are
  refused for everyone and the mount is always ``nosuid,nodev``.
- Who may ask: a process in a container that Allocate gave broker mode. Its mount
  namespace holds the broker's directory at ``/run/fuse-broker`` (Pod Security
  ``baseline`` forbids the hostPath a pod would need to fake it), and it proves it may
  open ``/dev/fuse`` by handing over its own open of it (the device cgroup rule that
  Allocate brings). A process whose root is not its namespace's root (chroot) is refused:
  its paths mean something else than the broker reads. A user namespace that maps the
  node's uid 0 is not a pod's (the kubelet never maps it) and is refused.
- Where: the path as the caller's namespace names it from its root, then the object the
  helper reached: not on a shared mount (the new mount would propagate to its peers,
  which may be outside the container); on a filesystem people keep data on (the list
  fusermount3 applies to users); and neither the path nor the mountpoint of the mount it
  is on may be in the kernel's or the image's system trees (``DENIED_TREES``). Renaming
  a parent cannot move a directory out of a mount, so the second test holds against
  renames; the first is what a read-only root filesystem makes hold too.
- As whom (callers that are not root on the node, fusermount3's rules for users): the
  mountpoint must be writable by the caller, judged by the helper with the caller's ids
  on the directory then mounted on; a sticky directory must be the caller's own;
  ``allow_other`` only where the node allows it (``--allow-other``); unmount only of the
  caller's own mounts.
- How many: mounts the broker made that the kernel still holds (lazily unmounted or
  hidden ones too) and mount requests in flight, per container, per pod and for the
  node (``admission`` keeps the count; these functions are the caps' words).
- Unmount: only a mount the broker made for this container, at exactly that path.
"""

from __future__ import annotations

import errno
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from fuse_plugin.broker.protocol import CONTAINER_DIR

MAX_PATH = 4095
MAX_OPTIONS = 3072
MAX_VALUE = 1024
# The kernel's trees (as in the AppArmor presets), the image's system trees, and where
# Allocate puts the broker: a FUSE filesystem belongs on a data path (/mnt, /data, /var,
# /home, /srv, /opt, /tmp, ...), and a FUSE daemon answering for /etc or /usr could feed
# any process that reads the container's files, the node's own tools included.
DENIED_TREES = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32",
                "/lib64", "/libx32", "/boot", CONTAINER_DIR)
# Mount types whose lookups can wait on a process: never resolved through, never
# mounted on. fuseblk too (block-device FUSE has a daemon like any FUSE). An entry that
# ends in "." is a prefix (fuse.sshfs, fuseblk.ntfs).
NO_WALK = ("fuse", "fuse.", "fuseblk", "fuseblk.", "autofs")
# The filesystems a FUSE mount may cover: fusermount3 (libfuse 3.14, util/fusermount.c)
# lets users mount only over a list like this one, to keep them off procfs files they
# can write to without owning; the broker applies it to every caller.
MOUNTABLE = frozenset((
    "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "nfs", "nfs4", "ceph",
    "cifs", "smb3", "f2fs", "squashfs", "iso9660", "zfs", "bcachefs", "jfs", "reiserfs",
    "gfs2", "gpfs", "ubifs", "ecryptfs", "exfat", "vfat", "msdos", "ntfs", "ntfs3",
    "hfs", "hfsplus", "aufs", "9p", "virtiofs", "erofs", "lustre"))
OPTION_PAIRS = {  # fusermount3's mount flags: name -> (group, on); the last one wins
    "rw": ("ro", False), "ro": ("ro", True), "exec": ("noexec", False),
    "noexec": ("noexec", True), "async": ("sync", False), "sync": ("sync", True),
    "atime": ("noatime", False), "noatime": ("noatime", True), "dirsync": ("dirsync", True),
    "nosuid": ("nosuid", True), "nodev": ("nodev", True)}
ESCAPED_VALUES = ("fsname", "subtype")  # fusermount3 honours backslash escapes in these
# A 32-bit unsigned number's digits, in ASCII alone (int() takes " 5", "+5" and other
# scripts' digits too); ten of them at most, so int() of a hostile value stays cheap.
UINT32_DIGITS = re.compile(r"[0-9]{1,10}")
_REFUSED_OPTIONS = {
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

    def __init__(self, message: str, kind: str = "request") -> None:
        super().__init__(message)
        self.kind = kind


# The errors of a broker short of descriptors or memory for a moment: the request is
# refused as "busy" and accepting pauses; the broker never exits on them.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class OutOfResources(Refused):
    """The broker itself is short of descriptors or memory: this request is refused as
    "busy" and the loop stops accepting for a moment."""

    def __init__(self, what: str, err: OSError) -> None:
        super().__init__(f"the broker is short of resources ({what}: "
                         f"{err.strerror or err}); try again", "busy")
        self.error = err


def out_of_resources(err: BaseException) -> bool:
    """Whether an error is the broker's own shortage (``RESOURCE_ERRNOS``)."""
    return isinstance(err, OSError) and err.errno in RESOURCE_ERRNOS


@dataclass(frozen=True)
class MountOptions:
    """The request's options, read once: what the helper hands to fsconfig and fsmount."""

    source: str = ""  # fsname=
    subtype: str = ""
    max_read: str = ""
    flags: tuple[str, ...] = ()  # fsconfig flags: default_permissions, allow_other, ro...
    attrs: tuple[str, ...] = ()  # mount attributes beyond nosuid,nodev: ro, noexec, noatime

    @property
    def allow_other(self) -> bool:
        return "allow_other" in self.flags


@dataclass(frozen=True)
class Mark:
    """The mount at /run/fuse-broker: device (major:minor) and root in that filesystem."""

    dev: str
    root: str


@dataclass(frozen=True)
class Target:
    """What the helper reached for a mount: the directory and the mount it is on."""

    mount_id: int
    fstype: str
    mount_point: str
    shared: bool  # the mount it is on is in a peer group (shared:N in mountinfo)
    mode: int
    owner: int  # as the caller's namespace names it
    writable: bool | None  # None: not judged (a root caller)
    uid: int  # the caller's ids in its namespace: the mount's user_id and group_id
    gid: int


@dataclass(frozen=True)
class Existing:
    """What the helper found at an unmount's path: the mount on top there."""

    mount_id: int
    fstype: str
    connection: int  # the FUSE connection: the minor of the superblock's device


@dataclass(frozen=True)
class Owner:
    """Whom the broker made a mount for (from its records)."""

    container: str
    uid: int


def is_fuse(fstype: str) -> bool:
    """FUSE of either kind, with or without a subtype."""
    return any(fstype == t or (t.endswith(".") and fstype.startswith(t))
               for t in NO_WALK if t.startswith("fuse"))


def split_options(text: str) -> list[str]:
    """Split at commas exactly as fusermount3 does: a backslash escapes the next
    character only inside fsname= and subtype= values."""
    options: list[str] = []
    i = 0
    while i < len(text):
        escaped = text.startswith(tuple(f"{name}=" for name in ESCAPED_VALUES), i)
        j = i
        while j < len(text) and text[j] != ",":
            j += 2 if escaped and text[j] == "\\" else 1
        options.append(text[i:min(j, len(text))])
        i = j + 1
    return options


def _unescape(name: str, value: str) -> str:
    if value.endswith("\\") and (len(value) - len(value.rstrip("\\"))) % 2:
        raise Refused(f"mount option {name}= ends in an unfinished escape", "option")
    return re.sub(r"\\(.)", r"\1", value)


def options(text: str) -> MountOptions:
    """The request's options as the mount will have them; ``Refused`` for any the broker
    does not allow."""
    if len(text) > MAX_OPTIONS:
        raise Refused(f"mount options longer than {MAX_OPTIONS} characters", "option")
    values: dict[str, str] = {}
    words: list[str] = []
    groups: dict[str, bool] = {}
    for option in split_options(text):
        if not option or option == "nonempty":  # fusermount3 accepts and ignores it
            continue
        name, sep, value = option.partition("=")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in option):
            raise Refused(f"control character in mount option {name[:64]!r}", "option")
        if name in _REFUSED_OPTIONS:
            raise Refused(f"mount option {name!r} refused: {_REFUSED_OPTIONS[name]}", "option")
        if sep and name in (*ESCAPED_VALUES, "max_read"):
            values[name] = _value(name, value)
        elif not sep and name in OPTION_PAIRS:
            group, on = OPTION_PAIRS[name]
            groups[group] = on
        elif not sep and name in ("default_permissions", "allow_other"):
            words.append(name)
        else:
            raise Refused(f"unknown mount option {option[:64]!r}", "option")
    flags = [*dict.fromkeys(words)]
    flags += [name for name in ("ro", "sync", "dirsync") if groups.get(name)]
    attrs = [name for name in ("ro", "noexec", "noatime") if groups.get(name)]
    return MountOptions(source=values.get("fsname", ""), subtype=values.get("subtype", ""),
                        max_read=values.get("max_read", ""), flags=tuple(flags),
                        attrs=tuple(attrs))


def _value(name: str, value: str) -> str:
    if name == "max_read":
        if not UINT32_DIGITS.fullmatch(value) or int(value) >= 1 << 32:
            raise Refused(f"max_read must be a number, got {value[:20]!r}", "option")
        return value
    value = _unescape(name, value)
    if not value or len(value) > MAX_VALUE:
        raise Refused(f"mount option {name}= needs a value of 1 to {MAX_VALUE} characters",
                      "option")
    return value


def path(text: str) -> str:
    """A canonical absolute path outside the denied trees, as the caller named it."""
    if not text.startswith("/") or len(text) > MAX_PATH:
        raise Refused(f"mountpoint must be an absolute path of at most {MAX_PATH} "
                      f"characters, got {text[:80]!r}", "path")
    parts = text.split("/")[1:]
    if text == "/" or any(p in ("", ".", "..") for p in parts):
        raise Refused(f"mountpoint {text[:200]!r} is not a canonical path below / "
                      "(no empty, '.' or '..' components)", "path")
    _outside_denied_trees(text, "mountpoint")
    return text


def _outside_denied_trees(text: str, what: str) -> None:
    for tree in DENIED_TREES:
        if text == tree or text.startswith(tree + "/"):
            raise Refused(f"{what} {text[:200]!r} is under {tree}: the broker does not "
                          "mount there", "path")


def caller(root: str, maps_node_root: bool) -> None:
    """Rules about the calling process itself (``caller.Caller`` reads the facts)."""
    if root != "/":
        raise Refused(f"the calling process's root is {root[:200]!r}, not its mount "
                      "namespace's root (chroot): the broker resolves paths from the "
                      "namespace's root", "caller")
    if maps_node_root:
        raise Refused("the caller's user namespace maps the node's uid 0: not a pod's "
                      "(the broker serves containers that Allocate gave the device)",
                      "caller")


def allocated(mark: Mark, ours: Mark) -> None:
    """The caller's namespace must hold the broker's directory where Allocate binds it."""
    if mark != ours:
        raise Refused("this container was not given broker mode by the device plugin "
                      "(no /run/fuse-broker bind of the broker's directory in its mount "
                      "namespace); request github.com/fuse in its own resources",
                      "allocation")


# A pod's cgroup as the kubelet names it, the parent of its containers' cgroups: cgroupfs
# ".../pod<uid>", systemd ".../kubepods-burstable-pod<uid_with_underscores>.slice".
POD_CGROUP = re.compile(r"(?:^|[-_])pod[0-9a-fA-F_-]+(?:\.slice)?$")


def container_of(cgroup: str) -> str:
    """The container a process belongs to, from its cgroup as the node's cgroup namespace
    names it: the cgroup just below the topmost pod cgroup on the path (the one the
    runtime made for the container), or, outside any pod, the path's first component.
    A tenant can make cgroups only below its own container's (in a cgroup namespace of
    its own, with a hierarchy it mounted there) and move its processes into them; what
    it makes there does not change what this returns, so its shares and caps hold
    whatever it does inside its namespaces."""
    parts = [part for part in cgroup.split("/") if part]
    for depth, part in enumerate(parts):
        if POD_CGROUP.search(part):
            return "/" + "/".join(parts[:depth + 2])
    return "/" + "/".join(parts[:1])


def pod_of(container: str) -> str:
    """The pod a container's cgroup belongs to, for the fair shares: its parent cgroup
    when that is a pod's, else the container itself (a container outside any pod's
    cgroup shares with no one)."""
    parent, _, _ = container.rstrip("/").rpartition("/")
    return parent if POD_CGROUP.search(parent.rpartition("/")[2]) else container


def room_in_pod(held: int, limit: int, pod: str) -> None:
    """A pod's share of the node's mounts: no pod can take the node-wide cap alone."""
    if held >= limit:
        raise Refused(f"the pod ({pod[:120]}) already holds {held} FUSE mounts made by the "
                      f"broker, its share (--max-mounts-pod {limit}); unmount one first",
                      "quota")


def room_for_another(held: int, limit: int, node_held: int, node_limit: int) -> None:
    if held >= limit:
        raise Refused(f"the container already holds {held} FUSE mounts made by the "
                      f"broker, its limit (--max-mounts {limit}); unmount one first",
                      "quota")
    if node_held >= node_limit:
        raise Refused(f"the node already holds {node_held} FUSE mounts made by the broker, "
                      f"its limit (--max-mounts-node {node_limit})", "quota")


def may_mount(target: Target, opts: MountOptions, node_root: bool, allow_other: bool, *,
              user_namespaced: bool = False) -> None:
    """Judge the directory the helper reached and the caller's right to mount there.

    ``allow_other`` is the node's choice for callers that share the node's users; a caller
    in a user namespace of its own (a ``hostUsers: false`` pod) may always ask for it: the
    mount's superblock belongs to that namespace, and the kernel lets only processes in it
    (or below it) past allow_other, so it opens the mount to the pod's other users and to
    nobody outside the pod. fuse-overlayfs asks for it whenever it runs as uid 0."""
    _outside_denied_trees(target.mount_point, "the mountpoint is on the mount at")
    if target.shared:
        raise Refused(f"the mountpoint is on a shared mount (at {target.mount_point[:200]!r}): "
                      "the FUSE mount would propagate to its peers, which may be outside "
                      "the container", "path")
    if target.fstype not in MOUNTABLE:
        raise Refused(f"the mountpoint is on a {target.fstype[:64]} filesystem (mounted at "
                      f"{target.mount_point[:200]!r}): FUSE mounts go on data filesystems "
                      f"only ({', '.join(sorted(MOUNTABLE)[:6])}, ...)", "path")
    if node_root:
        return
    if target.mode & stat.S_ISVTX and target.owner != target.uid:
        raise Refused(f"the mountpoint is sticky and owned by uid {target.owner}, not by "
                      f"the caller (uid {target.uid})", "permission")
    if not target.writable:
        raise Refused(f"the caller (uid {target.uid}) may not write the mountpoint "
                      f"(owner uid {target.owner}, mode {target.mode & 0o7777:o})",
                      "permission")
    if opts.allow_other and not (allow_other or user_namespaced):
        raise Refused("allow_other is not allowed on this node for callers that are not "
                      "root (the broker's --allow-other, like user_allow_other in "
                      "/etc/fuse.conf)", "option")


def may_unmount(found: Existing, owner: Owner | None, *, container: str, uid: int,
                node_root: bool, mount_id: int | None) -> None:
    """Only what the broker mounted for this container, and for a caller that is not
    root on the node only its own."""
    if not is_fuse(found.fstype):
        raise Refused(f"it is not a FUSE mount (it is {found.fstype[:64]})", "unmount")
    if owner is None or owner.container != container:
        raise Refused("it is not a mount the broker made for this container; the broker "
                      "removes only its own", "unmount")
    if not node_root and owner.uid != uid:
        raise Refused(f"it belongs to uid {owner.uid}, not to the caller (uid {uid})",
                      "permission")
    if mount_id is not None and mount_id != found.mount_id:
        raise Refused(f"it is now a different mount (id {found.mount_id}, not {mount_id})",
                      "unmount")


def kinds() -> Iterable[str]:
    """Every refusal kind, for the metrics' label values."""
    return ("request", "option", "path", "caller", "allocation", "quota", "permission",
            "unmount", "busy")
