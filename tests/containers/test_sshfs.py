"""sshfs in the recommended pod mounts a directory served by a private sshd on
127.0.0.1 (its own host key, a user key, key-only login); data goes both ways."""

from __future__ import annotations

import hashlib
import os

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, waiting, workloads
from tests.lib.servers import Sshd
from tests.lib.workloads import SSH_MOUNT


def test_sshfs_reads_and_writes_a_remote_directory(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc, sshd: Sshd) -> None:
    export = sshd.export
    (export / "from-server.txt").write_text("written on the server before the mount\n")
    work = workloads.sshfs(sshd, runc.base / "data-sshfs")
    container = runc.create(oci.build_spec(workloads.container_request(work, allocation)),
                            "sshfs").start()
    workloads.mount(container, work).check()
    assert (SSH_MOUNT, "fuse.sshfs") in container.mounts()
    [connection] = container.fuse_connections()

    # server -> mount
    got = container.exec("cat", f"{SSH_MOUNT}/from-server.txt").check().stdout
    assert got == "written on the server before the mount\n"

    # mount -> server: text and 1 MiB of random bytes, checked on the server's disk
    out = container.sh(f"printf 'written through sshfs\\n' > {SSH_MOUNT}/from-fuse.txt && "
                       f"mkdir {SSH_MOUNT}/dir && "
                       f"head -c 1048576 /dev/urandom > {SSH_MOUNT}/dir/blob.bin && "
                       f"sha256sum {SSH_MOUNT}/dir/blob.bin").check().stdout
    assert (export / "from-fuse.txt").read_text() == "written through sshfs\n"
    blob = (export / "dir" / "blob.bin").read_bytes()
    assert hashlib.sha256(blob).hexdigest() == out.split()[0]

    # server while mounted -> mount; rename through the mount -> server
    (export / "later.txt").write_text("written on the server while mounted\n")
    got = container.exec("cat", f"{SSH_MOUNT}/later.txt").check().stdout
    assert got == "written on the server while mounted\n"
    container.exec("mv", f"{SSH_MOUNT}/later.txt", f"{SSH_MOUNT}/dir/moved.txt").check()
    assert sorted(os.listdir(export / "dir")) == ["blob.bin", "moved.txt"]

    # a clean unmount, as a user would do it
    container.exec("fusermount3", "-u", SSH_MOUNT).check()
    assert container.mounts() == []
    waiting.wait_for(lambda: not (oci.FUSECTL / str(connection)).exists(), 10,
                       f"FUSE connection {connection} to close after fusermount3 -u")
