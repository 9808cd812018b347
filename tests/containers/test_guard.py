"""The guard every FUSE test runs under: a FUSE request that never gets an answer (its
daemon is stopped) hits the exec deadline, the harness aborts the container's FUSE
connection through fusectl, and the mount answers ENOTCONN instead of hanging."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, workloads
from tests.lib.servers import Sshd
from tests.lib.workloads import SSH_MOUNT


def test_a_hung_fuse_request_is_aborted_at_the_deadline(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc, sshd: Sshd) -> None:
    (sshd.export / "file.txt").write_text("x\n")
    work = workloads.sshfs(sshd, runc.base / "data-guard")
    container = runc.create(oci.build_spec(workloads.container_request(work, allocation)),
                            "guard").start()
    workloads.mount(container, work).check()
    [connection] = container.fuse_connections()
    [daemon] = [p for p in container.pids()
                if Path(f"/proc/{p}/comm").read_text().strip() == "sshfs"]
    os.kill(daemon, signal.SIGSTOP)  # our container's daemon: it will never answer
    try:
        aborted = rf"aborted FUSE connections \[{connection}\]"
        with pytest.raises(oci.ContainerTimeout, match=aborted):
            container.exec("cat", f"{SSH_MOUNT}/file.txt", timeout=2)
        after = container.exec("stat", SSH_MOUNT, timeout=5)
        assert after.returncode == 1
        assert "Transport endpoint is not connected" in after.stderr
    finally:
        os.kill(daemon, signal.SIGCONT)
