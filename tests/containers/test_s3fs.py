"""s3fs in the recommended pod (plugin's device, default capabilities + CAP_SYS_ADMIN,
the s3fs seccomp preset, not privileged) mounts a bucket of moto's real S3 server on
127.0.0.1; data goes both ways; the unmount ends the FUSE connection."""

from __future__ import annotations

import hashlib

from fuse_plugin.api import api_pb2 as api
from tests.lib import oci, waiting, workloads
from tests.lib.servers import Moto
from tests.lib.workloads import BUCKET, S3_MOUNT


def test_s3fs_reads_and_writes_a_bucket(allocation: api.ContainerAllocateResponse,
                                        runc: oci.Runc, moto: Moto) -> None:
    s3 = moto.client()
    before = "written through the S3 API before the mount\n"
    s3.put_object(Bucket=BUCKET, Key="from-api/before.txt", Body=before.encode())
    work = workloads.s3fs(moto, runc.base / "data-s3fs")
    container = runc.create(oci.build_spec(workloads.container_request(work, allocation)),
                            "s3fs").start()
    workloads.mount(container, work).check()
    assert (S3_MOUNT, "fuse.s3fs") in container.mounts()
    [connection] = container.fuse_connections()

    # S3 API -> mount
    assert container.exec("cat", f"{S3_MOUNT}/from-api/before.txt").check().stdout == before

    # mount -> S3 API: a text file and 1 MiB of random bytes
    text = "written through the s3fs mount\n"
    out = container.sh(f"printf '{text.strip()}\\n' > {S3_MOUNT}/from-fuse.txt && "
                       f"head -c 1048576 /dev/urandom > {S3_MOUNT}/blob.bin && "
                       f"sha256sum {S3_MOUNT}/blob.bin").check().stdout
    blob = s3.get_object(Bucket=BUCKET, Key="blob.bin")["Body"].read()
    assert len(blob) == 1048576
    assert hashlib.sha256(blob).hexdigest() == out.split()[0]
    assert s3.get_object(Bucket=BUCKET, Key="from-fuse.txt")["Body"].read().decode() == text

    # S3 API while mounted -> mount
    after = "written through the S3 API while mounted\n"
    s3.put_object(Bucket=BUCKET, Key="from-api/after.txt", Body=after.encode())
    assert container.exec("cat", f"{S3_MOUNT}/from-api/after.txt").check().stdout == after
    listing = container.exec("ls", f"{S3_MOUNT}/from-api").check().stdout.split()
    assert listing == ["after.txt", "before.txt"]

    # delete through the mount -> gone from the bucket
    container.exec("rm", f"{S3_MOUNT}/from-fuse.txt").check()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])}
    assert "from-fuse.txt" not in keys
    assert {"blob.bin", "from-api/before.txt", "from-api/after.txt"} <= keys

    # a clean unmount: the mount is gone and so is the FUSE connection (s3fs exited)
    container.exec(*work.unmount()).check()
    assert container.mounts() == []
    waiting.wait_for(lambda: not (oci.FUSECTL / str(connection)).exists(), 10,
                       f"FUSE connection {connection} to close after umount")
