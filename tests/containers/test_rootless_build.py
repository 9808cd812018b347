"""Rootless image builds (issue 36): buildah and podman as uid 1000 of a user-namespaced
container (``hostUsers: false``: 0 -> 100000, 65536) with no capability, the
rootless-build preset's seccomp profile and ``procMount: Unmasked``, storage ``overlay``
on an emptyDir. They build a Containerfile with FROM, COPY, RUN and a second stage that
copies from the first, with ``--network host`` (RUN uses the container's own network
namespace), and then run the image they built. No registry: the base image is made here
from busybox-static, the way tests/cluster/images.sh makes its base without a pull.

The controls show what makes it work: the same preset without what it adds to the
runtime default fails at buildah's first step with the error a cluster showed under
RuntimeDefault, and the masked /proc of ``procMount: Default`` fails the first RUN step.
No /dev/fuse: the kernel's overlay mounts in the build's own user namespace.
"""

from __future__ import annotations

import dataclasses
import io
import re
import shutil
import tarfile
from pathlib import Path

import pytest

from fuse_plugin import profiles
from fuse_plugin.profiles import seccomp
from tests.lib import oci

BUILDER_UID = 1000
PRESET = "rootless-build"
BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "cat", "echo", "id")
BUILD_TIMEOUT = 600.0

BASE_CONTAINERFILE = """\
FROM scratch
ADD base-rootfs.tar /
CMD ["/bin/sh"]
"""
CONTAINERFILE = """\
FROM localhost/base AS builder
RUN echo built in stage one > /stage1.txt && id -u >> /stage1.txt
FROM localhost/base
COPY hello.txt /hello.txt
COPY --from=builder /stage1.txt /from-builder.txt
RUN cat /hello.txt /from-builder.txt > /combined.txt
CMD ["cat", "/combined.txt"]
"""
HELLO = "hello from the build context"
# What the image's CMD prints: the context's file (COPY), the first stage's file (COPY
# --from) written by a RUN step as uid 0 of the build container.
IMAGE_OUTPUT = [HELLO, "built in stage one", "0"]
STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "/storage/graph"
runroot = "/storage/run"
rootless_storage_path = "/storage/graph"
"""
# The container's environment: everything the tools write goes to the emptyDir.
ENV = {"HOME": "/storage/home", "XDG_RUNTIME_DIR": "/storage/xdg", "TMPDIR": "/storage/tmp",
       "CONTAINERS_STORAGE_CONF": "/context/storage.conf", "LC_ALL": "C"}
PREPARE = 'set -eu; mkdir -p "$HOME" "$XDG_RUNTIME_DIR" "$TMPDIR"; cd /context; '
# Only a user namespace needs this error; buildah makes one for every subcommand but mount.
UNSHARE_REFUSED = "Error during unshare(CLONE_NEWUSER): Operation not permitted"
# runc (1.1) in the build's user namespace, where the kernel refuses a new procfs while
# the container's /proc has mounts over parts of it (mount_too_revealing).
MASKED_PROC = re.compile(r"mount proc:/proc .*: operation not permitted")

BUILDAH = PREPARE + """
echo "CAPS $(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)"
echo "UIDMAP $(cat /proc/self/uid_map)"
buildah build --network host -f Containerfile.base -t localhost/base .
buildah build --network host -f Containerfile -t localhost/app .
echo "DRIVER $(buildah info --format '{{.store.GraphDriverName}}')"
ctr=$(buildah from localhost/app)
buildah unshare sh -c 'echo "MOUNTED $(grep " $(buildah mount "$1") " /proc/self/mountinfo)"' \
    sh "$ctr"
echo RUN-BEGIN
buildah run --network host "$ctr" cat /combined.txt
echo RUN-END
buildah rm "$ctr" >/dev/null
"""
PODMAN = PREPARE + """
podman build --network host -f Containerfile.base -t localhost/base .
podman build --network host -f Containerfile -t localhost/app .
echo "DRIVER $(podman info --format '{{.Store.GraphDriverName}}')"
echo RUN-BEGIN
podman run --rm --network host localhost/app
echo RUN-END
"""


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build context: a base rootfs as a tarball, both Containerfiles, a file to COPY,
    storage.conf."""
    for tool in ("buildah", "podman", "runc"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: scripts/install --dev installs it from "
                        "scripts/apt-packages.txt")
    directory = tmp_path_factory.mktemp("build-context")
    with tarfile.open(directory / "base-rootfs.tar", "w") as tar:
        tar.add(BUSYBOX, "bin/busybox")
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(link, io.BytesIO())
    (directory / "Containerfile.base").write_text(BASE_CONTAINERFILE)
    (directory / "Containerfile").write_text(CONTAINERFILE)
    (directory / "hello.txt").write_text(HELLO + "\n")
    (directory / "storage.conf").write_text(STORAGE_CONF)
    for path in directory.iterdir():
        path.chmod(0o644)
    directory.chmod(0o755)
    return directory


def empty_dir(path: Path, mode: int = 0o777) -> Path:
    """A kubelet emptyDir: a host directory every uid of the pod may write."""
    path.mkdir(parents=True)
    path.chmod(mode)
    return path


def builder(runc: oci.Runc, context: Path, profile: str | dict[str, object],
            proc_unmasked: bool = True) -> oci.RuncContainer:
    """The build pod's container: uid 1000 of a user namespace, no capability, no privilege
    escalation, the given seccomp profile, the storage emptyDir and the context."""
    request = oci.ContainerRequest(
        args=["sleep", "infinity"], user=(BUILDER_UID, BUILDER_UID), host_users=False,
        drop_capabilities=(oci.DROP_ALL,), no_new_privileges=True, seccomp=profile,
        proc_unmasked=proc_unmasked, host_network=False, env=ENV,
        binds=[oci.Bind(empty_dir(runc.base / "storage"), "/storage"),
               # The image's /var/tmp (1777), where podman copies image configs.
               oci.Bind(empty_dir(runc.base / "var-tmp", 0o1777), "/var/tmp"),
               oci.Bind(context, "/context", readonly=True)])
    return runc.create(oci.build_spec(request), "build").start()


def between(output: str, start: str, end: str) -> list[str]:
    lines = output.splitlines()
    return lines[lines.index(start) + 1:lines.index(end)]


def tagged(output: str, tag: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith(f"{tag} ")]
    return line.removeprefix(f"{tag} ")


def test_buildah_builds_and_runs_an_image_as_uid_1000(context: Path, runc: oci.Runc) -> None:
    container = builder(runc, context, profiles.render_seccomp(PRESET))
    result = container.exec("/bin/sh", "-c", BUILDAH, timeout=BUILD_TIMEOUT)
    print(f"\n[buildah, rootless-build] rc={result.returncode}\n{result.stdout[-3000:]}")
    result.check()
    out = result.stdout
    assert tagged(out, "CAPS") == "0000000000000000"
    assert tagged(out, "UIDMAP").split() == ["0", str(oci.USERNS_HOST_ID),
                                             str(oci.USERNS_SIZE)]
    for step in ("[1/2] STEP 2/2: RUN echo built in stage one",
                 "[2/2] STEP 3/5: COPY --from=builder /stage1.txt /from-builder.txt",
                 "[2/2] STEP 4/5: RUN cat /hello.txt /from-builder.txt > /combined.txt"):
        assert any(line.startswith(step) for line in out.splitlines()), step
    # The kernel's overlay, mounted in buildah's own user namespace: no FUSE.
    assert tagged(out, "DRIVER") == "overlay"
    assert " - overlay overlay " in tagged(out, "MOUNTED")
    assert between(out, "RUN-BEGIN", "RUN-END") == IMAGE_OUTPUT


def test_podman_builds_and_runs_an_image_as_uid_1000(context: Path, runc: oci.Runc) -> None:
    container = builder(runc, context, profiles.render_seccomp(PRESET))
    result = container.exec("/bin/sh", "-c", PODMAN, timeout=BUILD_TIMEOUT)
    print(f"\n[podman, rootless-build] rc={result.returncode}\n{result.stdout[-3000:]}")
    result.check()
    assert tagged(result.stdout, "DRIVER") == "overlay"
    assert between(result.stdout, "RUN-BEGIN", "RUN-END") == IMAGE_OUTPUT


def test_without_the_presets_additions_buildah_cannot_make_its_user_namespace(
        context: Path, runc: oci.Runc) -> None:
    """The runtime default alone (the preset minus what it adds): what a 1.37 cluster
    showed under RuntimeDefault."""
    bare = dataclasses.replace(profiles.PRESETS[PRESET], syscalls=(), new_namespaces=(),
                               enosys=())
    container = builder(runc, context, seccomp.build(bare))
    result = container.exec("/bin/sh", "-c", BUILDAH, timeout=BUILD_TIMEOUT)
    print(f"\n[buildah, runtime default] rc={result.returncode}: {result.output[-600:]}")
    assert result.returncode != 0
    assert UNSHARE_REFUSED in result.output
    assert "STEP 1/3" not in result.output


def test_masked_proc_fails_the_first_run_step(context: Path, runc: oci.Runc) -> None:
    """``procMount: Default``: FROM and COPY work, RUN does not (its runtime cannot mount a
    procfs where the pod's /proc has masks over it). Why the pod is not at restricted."""
    container = builder(runc, context, profiles.render_seccomp(PRESET), proc_unmasked=False)
    result = container.exec("/bin/sh", "-c", BUILDAH, timeout=BUILD_TIMEOUT)
    print(f"\n[buildah, masked /proc] rc={result.returncode}: {result.output[-900:]}")
    assert result.returncode != 0
    assert "Successfully tagged localhost/base:latest" in result.output
    assert 'Error: building at STEP "RUN echo built in stage one' in result.output
    assert MASKED_PROC.search(result.output)
