"""The broker reads a caller's uid and gid as the kernel's unsigned ids: a user-namespaced
pod's ids on the node are high (the kubelet 1.37 gave one the range from 3581083648), and
read as signed they were negative and every request of such a pod failed."""

from __future__ import annotations

import os
import socket

import pytest

from fuse_plugin.broker import caller

HIGH = 3_581_084_648  # uid 1000 of the pod the cluster stage saw fail


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to take a uid above 2**31")
def test_identify_reads_unsigned_ids() -> None:
    # An abstract address: the caller's uid may not enter the test's temporary directory.
    path = f"\0fdp-caller-ids-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    server.settimeout(30)  # a deadline, should the child fail before it connects
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setresgid(HIGH + 1, HIGH + 1, HIGH + 1)
            os.setresuid(HIGH, HIGH, HIGH)
            with socket.socket(socket.AF_UNIX) as c:
                c.connect(path)
                c.recv(1)
        finally:
            os._exit(0)
    conn, _ = server.accept()
    try:
        who = caller.identify(conn)
        assert (who.uid, who.gid) == (HIGH, HIGH + 1)
    finally:
        conn.close()
        server.close()
        os.waitpid(child, 0)
