"""The Linux calls the broker's own process needs that Python's ``os`` lacks.

(Everything done in a caller's namespaces is ``native/helper.c``.) ``mount``, and
``setns`` (``os.setns`` is Python 3.12+), go through glibc's wrappers: their syscall
numbers differ between architectures. A failure is an ``OSError`` with the errno, as in
``os``.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)


def mount(source: str, target: str, fstype: str, flags: int) -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target), os.fsencode(fstype),
                   ctypes.c_ulong(flags), None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def setns(fd: int, nstype: int) -> None:
    """The calling thread joins the namespace ``fd`` names."""
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")
