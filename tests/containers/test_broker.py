"""Broker mode (issue 14) in real runc containers: the pod holds no added capability, the
runtime's default seccomp profile and no AppArmor change, only the plugin's broker-mode
Allocate answer. sshfs (libfuse 3) and s3fs (libfuse 2) mount through the shim and the
real broker, data goes both ways, ``fusermount3 -u`` unmounts. Controls: the same pod
without the broker's socket, and without broker mode at all, fails with the line users
see. A broker killed mid-request and restarted leaves existing mounts serving, and a mount
asked for while it is down waits for it."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import protocol
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, waiting, workloads
from tests.lib.broker import BrokerProcess
from tests.lib.servers import Moto, Sshd
from tests.lib.workloads import HELLO, S3_MOUNT, SSH_MOUNT, Workload, squash_image

CAP_SYS_ADMIN_BIT = 21
SQUASH_MOUNT = "/mnt/squash"


def broker_pod(work: Workload | None, allocation: api.ContainerAllocateResponse,
               extra_binds: tuple[oci.Bind, ...] = ()) -> oci.ContainerRequest:
    """A pod in broker mode: github.com/fuse and nothing else. containerd's default
    capabilities (no SYS_ADMIN), the runtime-default seccomp allow-list (no mount)."""
    binds = [*(work.binds if work else []), *extra_binds]
    return oci.ContainerRequest(args=workloads.HOLD, allocation=allocation,
                                seccomp=profiles.runtime_default(), binds=binds)


def assert_unprivileged(container: oci.RuncContainer) -> None:
    status = container.exec("cat", "/proc/self/status").check().stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert not int(fields["CapEff"], 16) >> CAP_SYS_ADMIN_BIT & 1
    assert fields["Seccomp"].strip() == "2"
    refused = container.sh("mkdir -p /mnt/t && mount -t tmpfs none /mnt/t")
    assert refused.returncode != 0


def test_allocate_in_broker_mode_binds_the_socket_dir_and_the_shim(
        broker_allocation: api.ContainerAllocateResponse, broker_dir: Path) -> None:
    assert [(d.container_path, d.permissions) for d in broker_allocation.devices] == [
        ("/dev/fuse", "rw")]
    assert [(m.container_path, m.host_path, m.read_only) for m in broker_allocation.mounts] == [
        (protocol.CONTAINER_DIR, str(broker_dir), True),
        *((target, str(broker_dir / protocol.SHIM_NAME), True)
          for target in protocol.SHIM_TARGETS)]
    assert not broker_allocation.envs


def test_sshfs_through_the_broker(broker_allocation: api.ContainerAllocateResponse,
                                  broker: BrokerProcess, runc: oci.Runc, sshd: Sshd) -> None:
    export = sshd.export
    (export / "from-server.txt").write_text("written on the server\n")
    work = workloads.sshfs(sshd, runc.base / "data-sshfs")
    container = runc.create(oci.build_spec(broker_pod(work, broker_allocation)),
                            "sshfs").start()
    assert_unprivileged(container)

    workloads.mount(container, work).check()
    assert (SSH_MOUNT, "fuse.sshfs") in container.mounts()
    [connection] = container.fuse_connections()
    assert container.exec("cat", f"{SSH_MOUNT}/from-server.txt").check().stdout == \
        "written on the server\n"
    out = container.sh(f"head -c 1048576 /dev/urandom > {SSH_MOUNT}/blob.bin && "
                       f"sha256sum {SSH_MOUNT}/blob.bin").check().stdout
    assert hashlib.sha256((export / "blob.bin").read_bytes()).hexdigest() == out.split()[0]
    options = next(line for line in container.exec("cat", "/proc/self/mountinfo")
                   .check().stdout.splitlines() if f" {SSH_MOUNT} " in line)
    assert {"nosuid", "nodev"} <= set(options.split()[5].split(","))

    [mounted] = broker.events("broker.mount")
    assert mounted["path"] == SSH_MOUNT
    assert "subtype=sshfs" in mounted["options"]

    container.exec("fusermount3", "-u", SSH_MOUNT).check()
    assert container.mounts() == []
    waiting.wait_for(lambda: not (oci.FUSECTL / str(connection)).exists(), 10,
                       f"FUSE connection {connection} to close after fusermount3 -u")
    assert [e["path"] for e in broker.events("broker.unmount")] == [SSH_MOUNT]


def test_s3fs_libfuse2_through_the_broker(broker_allocation: api.ContainerAllocateResponse,
                                          broker: BrokerProcess, runc: oci.Runc,
                                          moto: Moto) -> None:
    s3 = moto.client()
    s3.put_object(Bucket=workloads.BUCKET, Key="from-s3.txt", Body=b"written to S3\n")
    work = workloads.s3fs(moto, runc.base / "data-s3fs")
    container = runc.create(oci.build_spec(broker_pod(work, broker_allocation)),
                            "s3fs").start()
    workloads.mount(container, work).check()
    assert (S3_MOUNT, "fuse.s3fs") in container.mounts()
    assert container.exec("cat", f"{S3_MOUNT}/from-s3.txt").check().stdout == \
        "written to S3\n"
    container.sh(f"printf 'written through s3fs\\n' > {S3_MOUNT}/from-fuse.txt").check()
    body = s3.get_object(Bucket=workloads.BUCKET, Key="from-fuse.txt")["Body"].read()
    assert body == b"written through s3fs\n"
    # libfuse 2 runs `fusermount`, not fusermount3: the same shim answers both names.
    container.exec("fusermount", "-u", S3_MOUNT).check()
    assert container.mounts() == []


def test_without_the_socket_the_shim_says_so(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, tmp_path: Path) -> None:
    image = squash_image(tmp_path)
    allocation = broker_rig.without_socket(broker_allocation)
    container = runc.create(oci.build_spec(broker_pod(
        None, allocation, (oci.Bind(image, "/data/image.sqfs", True),))), "nosock").start()
    result = container.sh(f"mkdir -p {SQUASH_MOUNT} && squashfuse /data/image.sqfs "
                          f"{SQUASH_MOUNT}")
    assert result.returncode != 0
    assert ("fusermount3: cannot reach the FUSE mount broker at "
            f"{protocol.CONTAINER_SOCKET}: No such file or directory") in result.output
    assert "is not answering" not in result.output  # no directory: nothing to wait for
    assert container.mounts() == []
    assert broker.events("broker.mount") == []


def test_without_broker_mode_the_mount_is_refused(
        allocation: api.ContainerAllocateResponse, runc: oci.Runc, tmp_path: Path) -> None:
    """The same unprivileged pod with today's Allocate answer: the image's real
    fusermount3 cannot mount, so the broker is what makes the difference."""
    image = squash_image(tmp_path)
    container = runc.create(oci.build_spec(broker_pod(
        None, allocation, (oci.Bind(image, "/data/image.sqfs", True),))), "plain").start()
    result = container.sh(f"mkdir -p {SQUASH_MOUNT} && squashfuse /data/image.sqfs "
                          f"{SQUASH_MOUNT}")
    assert result.returncode != 0
    assert "fusermount3: mount failed: Operation not permitted" in result.output
    assert container.mounts() == []


def test_auto_unmount_when_the_daemon_dies(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, tmp_path: Path) -> None:
    image = squash_image(tmp_path)
    container = runc.create(oci.build_spec(broker_pod(
        None, broker_allocation, (oci.Bind(image, "/data/image.sqfs", True),))),
        "auto").start()
    container.sh(f"mkdir -p {SQUASH_MOUNT} && squashfuse -o auto_unmount "
                 f"/data/image.sqfs {SQUASH_MOUNT}").check()
    assert container.exec("cat", f"{SQUASH_MOUNT}/hello.txt").check().stdout == HELLO
    [mounted] = broker.events("broker.mount")
    assert "auto_unmount" not in mounted["options"]
    container.exec("pkill", "-KILL", "-x", "squashfuse").check()
    # The shim's request is not waited for by anyone here: wait for both its effects.
    waiting.wait_for(lambda: container.mounts() == [] and broker.events("broker.unmount"),
                       10, "the shim to have the dead mount unmounted")
    [unmounted] = broker.events("broker.unmount")
    assert unmounted["mount_id"] == mounted["mount_id"]


def test_broker_killed_mid_request_and_restarted(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, sshd: Sshd, tmp_path: Path) -> None:
    image = squash_image(tmp_path)
    work = workloads.sshfs(sshd, runc.base / "data-restart")
    client_dir = broker_rig.attacker_bind()
    container = runc.create(oci.build_spec(broker_pod(
        work, broker_allocation, (oci.Bind(image, "/data2/image.sqfs", True), client_dir))),
        "restart").start()
    workloads.mount(container, work).check()

    # A request in flight: connected, half sent (no complete message), when the broker dies.
    pending = subprocess.Popen(
        container.runc.command("exec", container.id, "python3", "-c",
                               _HALF_REQUEST.format(socket=protocol.CONTAINER_SOCKET)),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert pending.stdout is not None
    assert pending.stdout.readline() == b"connected\n"
    broker.kill()
    out, _ = pending.communicate(b"go\n", timeout=20)
    assert b"broker closed the connection" in out

    # Existing mount keeps serving, both ways, with no broker at all.
    (sshd.export / "after-kill.txt").write_text("still mounted\n")
    assert container.exec("cat", f"{SSH_MOUNT}/after-kill.txt").check().stdout == \
        "still mounted\n"
    container.sh(f"echo back > {SSH_MOUNT}/back.txt").check()
    assert (sshd.export / "back.txt").read_text() == "back\n"

    # A mount asked for while there is no broker (its socket left stale) waits for the
    # next one (issue 35) instead of failing. libfuse sends its first try's output to
    # /dev/null (it tries again without subtype= if that fails), so the sign that the
    # shim waits is the shim still running; tests/unit has the line it says.
    container.sh(f"mkdir -p {SQUASH_MOUNT}").check()
    log = tmp_path / "mount-while-down.log"
    with log.open("wb") as sink:
        asking = subprocess.Popen(
            container.runc.command("exec", container.id, "squashfuse", "/data2/image.sqfs",
                                   SQUASH_MOUNT),
            stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
    container.daemons.append(asking)
    waiting.wait_for(lambda: asking.poll() is not None or container.exec(
        "pgrep", "-x", protocol.SHIM_NAME).returncode == 0, 20,
        "the shim to wait for the broker", interval=0.2)
    assert asking.poll() is None, log.read_text()

    broker.start()  # the stale socket is replaced; the container sees the new one
    assert asking.wait(30) == 0, log.read_text()
    assert container.exec("cat", f"{SQUASH_MOUNT}/hello.txt").check().stdout == HELLO
    [_sshfs, squash] = broker.events("broker.mount")  # the log spans both brokers
    assert squash["path"] == SQUASH_MOUNT
    assert (SSH_MOUNT, "fuse.sshfs") in container.mounts()
    # Nothing was left in the killed broker's staging area: it died with its namespace.
    assert oci.fuse_mounts_of(broker.pid) == []


# Connect, say so, wait, then try to read a reply to a request that never completed.
_HALF_REQUEST = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({socket!r})
print("connected", flush=True)
sys.stdin.readline()
try:
    reply = s.recv(4096)
except ConnectionResetError:  # killed with our request unread: a reset, not an EOF
    reply = b""
print("the broker closed the connection" if not reply else reply, flush=True)
"""


MERGERFS_HELPER = "/usr/bin/mergerfs-fusermount"


def test_mergerfs_reaches_the_shim_through_its_own_helper_name(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc) -> None:
    """mergerfs carries its own libfuse, which runs a helper named mergerfs-fusermount
    before any fusermount; its package ships a real one. Allocate binds the shim there
    too, so mergerfs mounts through the broker like any libfuse program."""
    container = runc.create(oci.build_spec(broker_pod(None, broker_allocation)),
                            "mergerfs").start()
    script = ("mkdir -p /tmp/a /tmp/b /mnt/merged && echo one > /tmp/a/one && "
              "mergerfs /tmp/a:/tmp/b /mnt/merged && cat /mnt/merged/one && "
              "echo two > /mnt/merged/two && cat /tmp/a/two /tmp/b/two 2>/dev/null")
    result = container.sh(script)
    assert result.stdout.split() == ["one", "two"], result.output
    assert ("/mnt/merged", "fuse.mergerfs") in container.mounts()
    [mounted] = broker.events("broker.mount")
    assert mounted["path"] == "/mnt/merged"
    container.exec("fusermount", "-u", "/mnt/merged").check()
    assert container.mounts() == []


def test_without_the_shim_at_its_helper_name_mergerfs_finds_the_real_one(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc) -> None:
    """The failure the README's error table explains: the image's real helper cannot
    mount without CAP_SYS_ADMIN, and says so in fusermount's words."""
    allocation = api.ContainerAllocateResponse()
    allocation.CopyFrom(broker_allocation)
    del allocation.mounts[:]
    allocation.mounts.extend(m for m in broker_allocation.mounts
                             if m.container_path != MERGERFS_HELPER)
    container = runc.create(oci.build_spec(broker_pod(None, allocation)), "nomerge").start()
    result = container.sh("mkdir -p /tmp/a /mnt/merged && mergerfs /tmp/a /mnt/merged")
    assert result.returncode != 0
    assert "fusermount: mount failed: Operation not permitted" in result.output
    assert broker.events("broker.mount") == []
