"""FUSE at Pod Security "restricted" (issue 21): the broker mounts for callers that are not
root on the node, as themselves, with fusermount3's rules for users.

The pods have what restricted pods have: a non-root uid (one with no passwd entry too),
no capability, noNewPrivileges, a read-only root filesystem, the runtime-default seccomp
rules; and the user-namespaced variant (``hostUsers: false``: 0 -> 100000, 65536), as
root and as uid 1000 inside. The mount's user_id and group_id are the caller's, so
another uid in the same container cannot enter it without allow_other (the kernel's
rule), and the broker refuses what fusermount3 refuses users.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, workloads
from tests.lib.broker import BrokerProcess, attack
from tests.lib.servers import Moto, Sshd

TENANT = 1000
NOBODY_KNOWS = 123457  # a uid with no passwd entry, as OpenShift's restricted-v2 gives
MNT = "/mnt/fs"  # /mnt is an emptyDir (a tmpfs): the only writable place besides /tmp
FUSE = Path("/dev/fuse")


def passwd(directory: Path) -> Path:
    """The image's /etc/passwd: root and the tenant (ssh insists on an entry)."""
    path = directory / "passwd"
    path.write_text(f"root:x:0:0::/root:/bin/sh\ntenant:x:{TENANT}:{TENANT}::/tmp:/bin/sh\n")
    path.chmod(0o644)
    return path


def restricted(allocation: api.ContainerAllocateResponse, uid: int, directory: Path,
               binds: list[oci.Bind], **changes: Any) -> oci.ContainerRequest:
    """A pod with a complete restricted security context."""
    return oci.ContainerRequest(
        args=workloads.HOLD, allocation=allocation, user=(uid, uid), groups=(),
        no_new_privileges=True, readonly_rootfs=True, drop_capabilities=(oci.DROP_ALL,),
        seccomp=profiles.runtime_default(()), tmpfs=("/mnt",),
        binds=[*binds, oci.Bind(passwd(directory), "/etc/passwd", True),
               broker_rig.attacker_bind()], **changes)


def sshfs_command(sshd: Sshd, mountpoint: str) -> str:
    return (f"mkdir -p {mountpoint} && sshfs -p {sshd.port} -o idmap=user "
            f"-o IdentityFile={workloads.DATA}/id_ed25519 "
            f"-o UserKnownHostsFile={workloads.DATA}/known_hosts -o BatchMode=yes "
            f"-o StrictHostKeyChecking=yes root@127.0.0.1:{sshd.export} {mountpoint}")


def super_options(container: oci.RuncContainer, mountpoint: str) -> set[str]:
    line = next(row for row in Path(f"/proc/{container.pid}/mountinfo").read_text()
                .splitlines() if f" {mountpoint} " in row)
    return set(line.split(" - ")[1].split()[2].split(","))


def test_sshfs_as_uid_1000_with_what_restricted_pods_have(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, sshd: Sshd, tmp_path: Path) -> None:
    data = sshd.client_files(tmp_path / "ssh", owner=TENANT)
    spec = oci.build_spec(restricted(broker_allocation, TENANT, tmp_path,
                                     [oci.Bind(data, workloads.DATA, True)]))
    container = runc.create(spec, "restricted-sshfs").start()
    status = container.exec("grep", "-E", "^(Uid|CapEff|NoNewPrivs|Seccomp):",
                            "/proc/self/status").check().stdout
    assert "CapEff:\t0000000000000000" in status
    assert "NoNewPrivs:\t1" in status
    (sshd.export / "from-server.txt").write_text("written on the server\n")

    container.sh(sshfs_command(sshd, MNT)).check()
    assert (MNT, "fuse.sshfs") in container.mounts()
    assert {f"user_id={TENANT}", f"group_id={TENANT}"} <= super_options(container, MNT)
    assert container.exec("stat", "-c", "%u %g", f"{MNT}/from-server.txt").check().stdout \
        .split() == [str(TENANT), str(TENANT)]
    assert container.exec("cat", f"{MNT}/from-server.txt").check().stdout == \
        "written on the server\n"
    written = container.sh(f"head -c 65536 /dev/urandom > {MNT}/blob && "
                           f"sha256sum {MNT}/blob").check().stdout.split()[0]
    assert hashlib.sha256((sshd.export / "blob").read_bytes()).hexdigest() == written
    # Another uid in the same container: the kernel keeps it out (no allow_other).
    other = container.exec("ls", MNT, user="1001:1001")
    assert other.returncode != 0
    assert "Permission denied" in other.stderr
    [mounted] = broker.events("broker.mount")
    assert mounted["uid"] == TENANT

    container.exec("fusermount3", "-u", MNT).check()
    assert container.mounts() == []


def test_s3fs_as_a_uid_with_no_passwd_entry(
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, moto: Moto, tmp_path: Path) -> None:
    s3 = moto.client()
    s3.put_object(Bucket=workloads.BUCKET, Key="from-s3.txt", Body=b"written to S3\n")
    data = tmp_path / "s3"
    data.mkdir()
    moto.passwd_file(data / "passwd-s3fs", NOBODY_KNOWS)
    spec = oci.build_spec(restricted(broker_allocation, NOBODY_KNOWS, tmp_path,
                                     [oci.Bind(data, workloads.DATA, True)]))
    container = runc.create(spec, "nopasswd-s3fs").start()
    assert container.exec("id", "-un").returncode != 0  # no name for this uid
    container.sh(f"mkdir -p {MNT} && s3fs {workloads.BUCKET} {MNT} "
                 f"-o passwd_file={workloads.DATA}/passwd-s3fs -o url={moto.url} "
                 f"-o use_path_request_style -o endpoint={moto.REGION}").check()
    assert {f"user_id={NOBODY_KNOWS}"} <= super_options(container, MNT)
    assert container.exec("cat", f"{MNT}/from-s3.txt").check().stdout == "written to S3\n"
    # A key of its own: other tests' objects in the shared bucket belong to their uids.
    container.sh(f"printf 'back\\n' > {MNT}/from-{NOBODY_KNOWS}.txt").check()
    assert s3.get_object(Bucket=workloads.BUCKET,
                         Key=f"from-{NOBODY_KNOWS}.txt")["Body"].read() == b"back\n"
    container.exec("fusermount", "-u", MNT).check()
    assert container.mounts() == []


@pytest.mark.parametrize("uid", [0, TENANT], ids=["root inside", "uid 1000 inside"])
def test_user_namespaced_pods_mount_as_themselves(  # noqa: PLR0917
        broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
        runc: oci.Runc, sshd: Sshd, tmp_path: Path, uid: int) -> None:
    """hostUsers: false. The superblock belongs to the pod's user namespace, so the
    mount's ids are the caller's as the pod names them, and files its daemon reports as
    the caller's (idmap=user) appear owned by the caller inside."""
    host_uid = oci.USERNS_HOST_ID + uid
    data = sshd.client_files(tmp_path / "ssh", owner=host_uid)
    tmp_path.chmod(0o755)
    spec = oci.build_spec(restricted(broker_allocation, uid, tmp_path,
                                     [oci.Bind(data, workloads.DATA, True)],
                                     host_users=False))
    container = runc.create(spec, f"userns-{uid}").start()
    container.sh(sshfs_command(sshd, MNT)).check()
    assert {f"user_id={uid}", f"group_id={uid}"} <= super_options(container, MNT)
    assert container.exec("stat", "-c", "%u", MNT).check().stdout.strip() == str(uid)
    container.sh(f"echo from-userns > {MNT}/userns-{uid}.txt").check()
    assert (sshd.export / f"userns-{uid}.txt").read_text() == "from-userns\n"
    [mounted] = broker.events("broker.mount")
    assert mounted["uid"] == host_uid  # the node's view of the caller
    container.exec("fusermount3", "-u", MNT).check()
    assert container.mounts() == []


# -- what fusermount3 refuses users, the broker refuses ------------------------------------


@pytest.fixture
def tenant(broker_allocation: api.ContainerAllocateResponse, broker: BrokerProcess,
           runc: oci.Runc, tmp_path: Path) -> oci.RuncContainer:
    """A restricted container with directories of other owners in it, made by execs as
    those uids: root's 0755 /mnt/rootdir, uid 1001's 0755 /tmp/theirs (sticky /tmp),
    the tenant's /tmp/mine, and /mnt/race with the tenant's a and root's b."""
    spec = oci.build_spec(restricted(broker_allocation, TENANT, tmp_path, []))
    container = runc.create(spec, "tenant").start()
    container.exec("sh", "-c", "mkdir -m 0755 /mnt/rootdir && mkdir -m 0777 /mnt/race && "
                   "mkdir -m 0755 /mnt/race/b", user="0:0").check()
    container.exec("mkdir", "-m", "0755", "/tmp/theirs", user="1001:1001").check()
    container.exec("mkdir", "-p", "/tmp/mine", "/mnt/race/a").check()
    return container


@pytest.mark.parametrize(("path", "options", "words"), [
    ("/mnt/rootdir", "", "may not write the mountpoint (owner uid 0, mode 755)"),
    ("/tmp/theirs", "", "may not write the mountpoint (owner uid 1001, mode 755)"),
    ("/tmp", "", "the mountpoint is sticky and owned by uid 0"),
    ("/tmp/mine", "allow_other", "allow_other is not allowed on this node"),
    ("/tmp/mine", "suid", "always nosuid,nodev"),
    ("/tmp/mine", "dev", "always nosuid,nodev"),
])
def test_what_fusermount3_refuses_users_is_refused(tenant: oci.RuncContainer,
                                                   broker: BrokerProcess, path: str,
                                                   options: str, words: str) -> None:
    answer = attack(tenant, "ask", "--fuse", "op=mount", f"path={path}",
                    f"options={options}")
    assert answer["status"] == "error"
    assert words in answer["message"]
    [refused] = broker.events("broker.refused")
    assert words in refused["reason"]
    assert tenant.mounts() == []


def test_a_uid_cannot_unmount_another_uids_mount(tenant: oci.RuncContainer,
                                                 broker: BrokerProcess) -> None:
    held = broker_rig.Held(tenant, "hold", "/tmp/mine")
    assert held.answer["status"] == "ok"
    answer = attack(tenant, "ask", "op=unmount", "path=/tmp/mine", user="1001:1001")
    assert "belongs to uid 1000, not to the caller (uid 1001)" in answer["message"]
    assert ("/tmp/mine", "fuse") in tenant.mounts()
    assert attack(tenant, "ask", "op=unmount", "path=/tmp/mine")["status"] == "ok"
    held.release()


def test_renames_and_symlink_swaps_never_mount_on_a_directory_the_caller_cannot_write(
        tenant: oci.RuncContainer, broker: BrokerProcess) -> None:
    """/mnt/race/a is the caller's, /mnt/race/b root's; a thread swaps them and turns a
    into a symlink to b while the caller asks for /mnt/race/a, two thousand times. The
    check and the mount use one file descriptor, so whatever wins the race, the mount is
    on a directory the caller may write, or there is none."""
    result = attack(tenant, "swap-race", "/mnt/race", "2000", timeout=600)
    assert result["swaps"] > 0
    assert result["outcome"].get("not own", 0) == 0, result
    assert result["outcome"].get("own", 0) > 0, result
    assert result["outcome"].get("refused", 0) > 0, result
    assert tenant.mounts() == []
