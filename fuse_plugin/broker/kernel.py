"""The Linux calls the broker needs and Python's ``os`` lacks, through ctypes.

(The step inside a caller's namespace, setns and move_mount or umount2, is
native/enter.c.) openat2, open_tree and mount_setattr have one number on every architecture
(they came after the syscall tables were unified at 424), so calling them through
``syscall(2)`` is portable. unshare, mount and umount2 are older and have
per-architecture numbers, so they go through their glibc wrappers. Every failure is an
``OSError`` with the errno, as in ``os``.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

SYS_OPEN_TREE = 428
SYS_OPENAT2 = 437
SYS_MOUNT_SETATTR = 442

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
CLONE_NEWNS = 0x00020000
MS_PRIVATE = 1 << 18
MS_REC = 0x4000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MNT_DETACH = 0x2
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_IN_ROOT = 0x10
SO_PEERPIDFD = 77  # asm-generic value (x86, arm); Linux 6.5+


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _syscall(number: int, what: str, *args: object) -> int:
    return _check(int(_libc.syscall(number, *args)), what)


def openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags=flags, mode=0, resolve=resolve)
    return _syscall(SYS_OPENAT2, "openat2", ctypes.c_int(dirfd), os.fsencode(path),
                    ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))


def open_tree_clone(path: str) -> int:
    """A detached copy of the mount at ``path`` (like a bind mount not yet attached)."""
    return _syscall(SYS_OPEN_TREE, "open_tree", ctypes.c_int(AT_FDCWD), os.fsencode(path),
                    ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC))


def force_nosuid_nodev_private(tree_fd: int) -> None:
    attr = _MountAttr(attr_set=MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, attr_clr=0,
                      propagation=MS_PRIVATE, userns_fd=0)
    _syscall(SYS_MOUNT_SETATTR, "mount_setattr", ctypes.c_int(tree_fd), b"",
             ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr),
             ctypes.c_size_t(ctypes.sizeof(attr)))


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    def arg(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    _check(_libc.mount(arg(source), arg(target), arg(fstype), ctypes.c_ulong(flags),
                       arg(data)), f"mount {target}")


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(os.fsencode(target), ctypes.c_int(flags)), f"umount {target}")


def fd_mount_id(fd: int) -> int:
    """The mount an fd is on, from its fdinfo (no call into the filesystem)."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key == "mnt_id":
                return int(value)
    raise OSError(f"/proc/self/fdinfo/{fd} has no mnt_id")
