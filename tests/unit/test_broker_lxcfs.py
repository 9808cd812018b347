"""LXCFS views without containers: the files and the mount point are one list in Python
(``broker/lxcfs.py``) and in C (``native/lxcfs.c``), the shim's ``later`` field is the
broker's, and the request takes no field a caller could aim with."""

from __future__ import annotations

import logging
import os
import re
import selectors
import socket
from pathlib import Path

import pytest

from fuse_plugin.broker import cgroups, lxcfs, policy, protocol
from fuse_plugin.broker.lxcfs_records import Consumer
from tests.lib import broker as broker_rig

TOOL_SOURCE = broker_rig.NATIVE / "lxcfs.c"


def test_the_tool_binds_exactly_the_listed_files() -> None:
    source = TOOL_SOURCE.read_text()
    targets = re.findall(r'^\t\{ "([^"]+)", "([^"]+)", "[^"]+", "[^"]+" \},$', source,
                         re.MULTILINE)
    assert tuple(f"{d}/{n}" for d, n in targets) == lxcfs.FILES
    assert re.search(rf'^#define LXCFS_DIR "{lxcfs.MOUNTPOINT}"$', source, re.MULTILINE)


def test_the_shim_reads_the_later_field() -> None:
    source = broker_rig.SHIM_SOURCE.read_text()
    assert f'#define LATER_FIELD "{lxcfs.LATER_FIELD}"' in source


def test_a_request_is_v_and_op_only() -> None:
    assert lxcfs.asks(protocol.encode(v=protocol.VERSION, op=lxcfs.OP))
    assert not lxcfs.asks(protocol.encode(v=protocol.VERSION, op="mount", path="/x"))
    assert not lxcfs.asks(b"not a message")
    lxcfs.check_request(protocol.encode(v=protocol.VERSION, op=lxcfs.OP))


@pytest.mark.parametrize(("fields", "words"), [
    ({"v": protocol.VERSION, "op": lxcfs.OP, "path": "/etc"}, "no field but v and op"),
    ({"v": protocol.VERSION, "op": lxcfs.OP, "fuse_fd": "3"}, "no field but v and op"),
    ({"v": "1", "op": lxcfs.OP}, "different releases"),
    ({"op": lxcfs.OP}, "different releases"),
])
def test_a_request_with_more_is_refused(fields: dict[str, str], words: str) -> None:
    with pytest.raises(policy.Refused, match=words) as refused:
        lxcfs.check_request(protocol.encode(**fields))
    assert refused.value.kind == "request"


def test_a_bind_past_its_deadline_is_killed_once_and_holds_its_pod_not_the_loop(
        tmp_path: Path) -> None:
    """A tool that outlives its SIGKILL (one waiting in the kernel on a tenant) must not
    make the loop spin on a deadline already past (the broker ran at 87-100 % of a core),
    takes no node-wide slot, holds its own pod's further binds, and never holds the
    broker's stop (close kills and waits for nothing)."""
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\nexec sleep 60\n")
    tool.chmod(0o755)
    selector = selectors.DefaultSelector()
    views = lxcfs.Views(selector, tool=tool, directory=tmp_path / "dir",
                        state=tmp_path / "state", mark=policy.Mark("0:1", "/"),
                        charge=cgroups.Charge(()), log=logging.getLogger("test"),
                        answer=lambda *_: None)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    views.instance = lxcfs.Instance(left, os.getpid(), os.open("/proc/self/ns/mnt",
                                                                os.O_RDONLY))
    pod = "/kubepods/pod0f1e2d3c/c1"
    consumer = Consumer(pod, os.getpid(), os.pidfd_open(os.getpid()),
                        os.open("/proc/self/ns/mnt", os.O_RDONLY))
    try:
        views._queue(lxcfs.Bind(consumer, views.instance, None))
        [bind] = views.running
        assert views.soonest() == [bind.deadline]
        views.expire(bind.deadline)
        assert bind.killed
        assert views.soonest() == []  # waited for on its pidfd, never polled again
        assert views._stuck(policy.pod_of(pod))
        assert not views._stuck("/kubepods/podother")
        views.close()
        assert bind.proc is not None
        assert bind.proc.returncode is None  # not waited for
        bind.proc.wait(10)
    finally:
        right.close()
        selector.close()
