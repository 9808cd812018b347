"""Rootless image builds (issue 36): manifests/examples/rootless-build/build-pod.yaml's
own script, ConfigMap and security context, in runc. buildah and podman as uid 1000 of a
user-namespaced container (``hostUsers: false``: 0 -> 100000, 65536) with no capability,
no privilege escalation, the rootless-build preset's seccomp profile and ``procMount:
Unmasked``, storage ``overlay`` on an emptyDir. The script builds a base image from
busybox-static (no registry), then the example's Containerfile (FROM, COPY, RUN and a
second stage that copies from the first) with each tool, ``--network host``, and runs
both images.

The controls show what makes it work: the same preset without what it adds to the
runtime default fails at buildah's first step with the error a 1.37 cluster showed under
RuntimeDefault, and the masked /proc of ``procMount: Default`` fails the first RUN step.
No /dev/fuse: the kernel's overlay mounts in the build's own user namespace (and
fuse-overlayfs, with the pod's /dev/fuse, where it cannot). What differs from a node: the
image is this machine's /usr (its buildah 1.28, podman 4.3, runc 1.1), and no AppArmor
(this kernel has none).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin import profiles
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.profiles import seccomp
from tests.lib import oci
from tests.lib.manifests import EXAMPLES, Doc, containers, one, pod_spec
from tests.lib.node import UDEV_MODE, host_fuse_mode

EXAMPLE = EXAMPLES / "rootless-build" / "build-pod.yaml"
POD = one(EXAMPLE, "Pod")
CONFIGMAP = one(EXAMPLE, "ConfigMap")
[CONTAINER] = containers(POD)
CONTEXT = "/mnt/context"
BUILD_TIMEOUT = 600.0
# What each image's CMD prints (a RUN step's file from the context's file and the first
# stage's, written as uid 0 of the build container), as the script's `RAN` lines join it.
IMAGE_OUTPUT = "hello from the build context built in stage one 0 "
# Only a user namespace needs this; buildah makes one for every subcommand but mount.
UNSHARE_REFUSED = "Error during unshare(CLONE_NEWUSER): Operation not permitted"
# runc (1.1) in the build's user namespace, where the kernel refuses a new procfs while
# the container's /proc has mounts over parts of it (mount_too_revealing).
MASKED_PROC = re.compile(r"mount proc:/proc .*: operation not permitted")
# runc (1.1) when its child's unshare() of the namespaces is refused (a cgroup one here).
CHILD_FAILED = "error waiting for our first child to exit: exit status 1"
# After the script, in the same container: what it ran as, and what its layers are.
FACTS = """
echo "CGROUPFS $(stat -f -c %T /sys/fs/cgroup)"
echo "CAPS $(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)"
echo "UIDMAP $(cat /proc/self/uid_map)"
echo "DRIVER $(buildah info --format '{{.store.GraphDriverName}}')"
ctr=$(buildah from localhost/hello:buildah)
buildah unshare sh -c 'echo "MOUNTED $(grep " $(buildah mount "$1") " /proc/self/mountinfo)"' \
    sh "$ctr"
"""


def configmap_volume(directory: Path, data: dict[str, str]) -> Path:
    """A ConfigMap's volume: its keys as files."""
    for key, text in data.items():
        (directory / key).write_text(text)
        (directory / key).chmod(0o644)
    directory.chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("buildah", "podman", "runc", "busybox", "fuse-overlayfs"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: scripts/install --dev installs it from "
                        "scripts/apt-packages.txt")
    return configmap_volume(tmp_path_factory.mktemp("configmap"), CONFIGMAP["data"])


@pytest.fixture(scope="module")
def cgroup2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cgroup v2 hierarchy to show the build at /sys/fs/cgroup, as a 1.37 node has
    (the kubelet refuses cgroup v1 by default since 1.35; this machine may be on v1)."""
    path = tmp_path_factory.mktemp("cgroup2")
    subprocess.run(["mount", "-t", "cgroup2", "cgroup2", str(path)], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, capture_output=True)


def empty_dir(path: Path) -> Path:
    """A kubelet emptyDir: a host directory every uid of the pod may write."""
    path.mkdir(parents=True)
    path.chmod(0o777)
    return path


def builder(runc: oci.Runc, context: Path, profile: str | dict[str, object], *,
            proc_unmasked: bool = True, cgroup2: Path | None = None,
            allocation: api.ContainerAllocateResponse | None = None) -> oci.RuncContainer:
    """The example's container: its uid, capabilities, privilege escalation, procMount,
    environment and volumes, with the given seccomp profile; ``cgroup2`` is bound over
    /sys/fs/cgroup, read-only; ``allocation`` is the plugin's answer for a container that
    also asks for ``github.com/fuse``."""
    sc = CONTAINER["securityContext"]
    volumes = {v["name"]: v for v in pod_spec(POD)["volumes"]}
    binds = [oci.Bind(context, m["mountPath"], readonly=True) if "configMap" in volumes[
        m["name"]] else oci.Bind(empty_dir(runc.base / m["name"]), m["mountPath"])
        for m in CONTAINER["volumeMounts"]]
    request = oci.ContainerRequest(
        args=["sleep", "infinity"], allocation=allocation,
        user=(sc["runAsUser"], sc["runAsGroup"]),
        host_users=pod_spec(POD)["hostUsers"], drop_capabilities=tuple(
            sc["capabilities"]["drop"]), add_capabilities=tuple(
            sc["capabilities"].get("add", [])),
        no_new_privileges=not sc["allowPrivilegeEscalation"], seccomp=profile,
        proc_unmasked=proc_unmasked, readonly_rootfs=sc["readOnlyRootFilesystem"],
        host_network=False, env={e["name"]: e["value"] for e in CONTAINER["env"]},
        binds=binds)
    spec = oci.build_spec(request)
    if cgroup2 is not None:
        spec["mounts"].append({"destination": "/sys/fs/cgroup", "type": "bind",
                               "source": str(cgroup2), "options": ["rbind", "ro"]})
    return runc.create(spec, "build").start()


def build(container: oci.RuncContainer, then: str = "") -> oci.Result:
    """The example's build script, as its command runs it, and ``then`` after it."""
    return container.exec("/bin/sh", "-c", f"sh {CONTEXT}/build.sh && {{ {then} true; }}",
                          timeout=BUILD_TIMEOUT)


def tagged(output: str, tag: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith(f"{tag} ")]
    return line.removeprefix(f"{tag} ")


def test_example_runs_the_build_script_it_ships() -> None:
    command = CONTAINER["command"]
    assert command == ["/bin/sh", "-c", f"sh {CONTEXT}/build.sh && exec sleep infinity"]
    assert {m["mountPath"] for m in CONTAINER["volumeMounts"]} >= {CONTEXT}
    localhost = CONTAINER["securityContext"]["seccompProfile"]["localhostProfile"]
    assert localhost == profiles.seccomp_localhost_profile("rootless-build")


@pytest.mark.parametrize("cgroups", ["this-machine", "v2"])
def test_buildah_and_podman_build_and_run_images_as_uid_1000(
        context: Path, runc: oci.Runc, request: pytest.FixtureRequest, cgroups: str) -> None:
    preset = profile_of(CONTAINER)
    hierarchy = request.getfixturevalue("cgroup2") if cgroups == "v2" else None
    container = builder(runc, context, profiles.render_seccomp(preset), cgroup2=hierarchy)
    result = build(container, FACTS)
    print(f"\n[the example's build, {preset}] rc={result.returncode}\n{result.stdout[-4000:]}")
    result.check()
    out = result.stdout
    for step in ("[1/2] STEP 2/2: RUN echo built in stage one",
                 "[2/2] STEP 3/5: COPY --from=builder /stage1.txt /from-builder.txt",
                 "[2/2] STEP 4/5: RUN cat /hello.txt /from-builder.txt > /combined.txt"):
        assert sum(line.startswith(step) for line in out.splitlines()) == 2, step
    assert tagged(out, "RAN buildah:") == IMAGE_OUTPUT
    assert tagged(out, "RAN podman:") == IMAGE_OUTPUT
    assert tagged(out, "CAPS") == "0000000000000000"
    assert tagged(out, "UIDMAP").split() == ["0", str(oci.USERNS_HOST_ID),
                                             str(oci.USERNS_SIZE)]
    # The kernel's overlay, mounted in buildah's own user namespace: no FUSE.
    assert tagged(out, "DRIVER") == "overlay"
    assert " - overlay overlay " in tagged(out, "MOUNTED")
    assert not Path(f"/proc/{container.pid}/root/dev/fuse").exists()
    if hierarchy is not None:
        assert tagged(out, "CGROUPFS") == "cgroup2fs"


def profile_of(container: Doc) -> str:
    localhost = str(container["securityContext"]["seccompProfile"]["localhostProfile"])
    return localhost.removeprefix(f"{profiles.SECCOMP_SUBDIR}/").removesuffix(".json")


def test_without_the_presets_additions_buildah_cannot_make_its_user_namespace(
        context: Path, runc: oci.Runc) -> None:
    """The runtime default alone (the preset minus what it adds): what a 1.37 cluster
    showed under RuntimeDefault."""
    bare = dataclasses.replace(profiles.PRESETS[profile_of(CONTAINER)], syscalls=(),
                               new_namespaces=(), enosys=())
    container = builder(runc, context, seccomp.build(bare))
    result = build(container)
    print(f"\n[runtime default] rc={result.returncode}: {result.output[-600:]}")
    assert result.returncode != 0
    assert UNSHARE_REFUSED in result.output
    assert "STEP 1/" not in result.output


def test_masked_proc_fails_the_first_run_step(context: Path, runc: oci.Runc) -> None:
    """``procMount: Default``: FROM and COPY work, RUN does not. What keeps the example
    from Pod Security `restricted`."""
    container = builder(runc, context, profiles.render_seccomp(profile_of(CONTAINER)),
                        proc_unmasked=False)
    result = build(container)
    print(f"\n[masked /proc] rc={result.returncode}: {result.output[-900:]}")
    assert result.returncode != 0
    assert "Successfully tagged localhost/base:latest" in result.output
    assert 'Error: building at STEP "RUN echo built in stage one' in result.output
    assert MASKED_PROC.search(result.output)


@pytest.mark.usefixtures("context")
@pytest.mark.parametrize("cgroup_namespaces", [False, True], ids=["refused", "allowed"])
def test_on_cgroup_v2_runs_need_cgroupns_host_because_the_profile_refuses_cgroup_namespaces(
        tmp_path: Path, cgroup2: Path, runc: oci.Runc, cgroup_namespaces: bool) -> None:
    """The example's script without ``--cgroupns host`` on cgroup v2: RUN steps ask for a
    cgroup namespace of their own, which the preset refuses (the control: the preset
    with cgroup namespaces added lets the same script through)."""
    data = {**CONFIGMAP["data"],
            "build.sh": CONFIGMAP["data"]["build.sh"].replace(" --cgroupns host", "")}
    assert data["build.sh"] != CONFIGMAP["data"]["build.sh"]
    preset = profiles.PRESETS[profile_of(CONTAINER)]
    if cgroup_namespaces:
        preset = dataclasses.replace(preset, new_namespaces=(*preset.new_namespaces, "cgroup"))
    (tmp_path / "configmap").mkdir()
    volume = configmap_volume(tmp_path / "configmap", data)
    container = builder(runc, volume, seccomp.build(preset), cgroup2=cgroup2)
    result = build(container)
    print(f"\n[cgroup v2, no --cgroupns host, cgroup namespaces {cgroup_namespaces}] "
          f"rc={result.returncode}: {result.output[-600:]}")
    if cgroup_namespaces:
        result.check()
        assert tagged(result.stdout, "RAN podman:") == IMAGE_OUTPUT
    else:
        assert result.returncode != 0
        assert 'Error: building at STEP "RUN echo built in stage one' in result.output
        assert CHILD_FAILED in result.output


@pytest.mark.usefixtures("context")
def test_fuse_overlayfs_in_the_builds_own_user_namespace(
        tmp_path: Path, runc: oci.Runc, allocation: api.ContainerAllocateResponse) -> None:
    """Where the kernel refuses overlay in a user namespace: fuse-overlayfs as the
    storage's mount program, mounting FUSE itself in the build's user namespace with the
    pod's /dev/fuse (``github.com/fuse: 1``, the node's node at 0666), no broker. Under
    the seccomp profile only: containers/storage starts fuse-overlayfs without nosuid,
    which the AppArmor profile's FUSE rules require (docs/profiles.md)."""
    storage = CONFIGMAP["data"]["storage.conf"] + (
        'mount_program = "/usr/bin/fuse-overlayfs"\n')
    (tmp_path / "configmap").mkdir()
    volume = configmap_volume(tmp_path / "configmap", {**CONFIGMAP["data"],
                                                      "storage.conf": storage})
    with host_fuse_mode(UDEV_MODE):
        container = builder(runc, volume, profiles.render_seccomp(profile_of(CONTAINER)),
                            allocation=allocation)
        result = build(container, FACTS)
    print(f"\n[fuse-overlayfs] rc={result.returncode}: {result.stdout[-1500:]}")
    result.check()
    assert tagged(result.stdout, "RAN buildah:") == IMAGE_OUTPUT
    assert tagged(result.stdout, "RAN podman:") == IMAGE_OUTPUT
    mounted = tagged(result.stdout, "MOUNTED")
    assert " - fuse.fuse-overlayfs fuse-overlayfs " in mounted
    # Without nosuid: what keeps this way off AppArmor nodes.
    assert "nosuid" not in mounted.split(" - ")[0]


def without(addition: str) -> profiles.Preset:
    """The preset without one of its additions: ``namespace-NAME``, a system call, or
    ``enosys-NAME`` (the call then gets EPERM, as the runtime default answers)."""
    preset = profiles.PRESETS[profile_of(CONTAINER)]
    kind, _, name = addition.rpartition("-")
    if kind == "namespace":
        assert name in preset.new_namespaces
        return dataclasses.replace(
            preset, new_namespaces=tuple(n for n in preset.new_namespaces if n != name))
    if kind == "enosys":
        assert name in preset.enosys
        return dataclasses.replace(preset, enosys=tuple(c for c in preset.enosys
                                                        if c != name))
    assert addition in preset.syscalls
    return dataclasses.replace(
        preset, syscalls=tuple(c for c in preset.syscalls if c != addition))


# Each addition left out, and what buildah, podman or their runc then says.
NEEDED = {
    "namespace-user": UNSHARE_REFUSED,
    "namespace-mount": "Error during unshare(...): Operation not permitted",
    "namespace-uts": "failed to unshare remaining namespaces",
    "namespace-ipc": "failed to unshare remaining namespaces",
    "namespace-pid": "failed to unshare remaining namespaces",
    "mount": "mount /var/lib/build/storage/overlay",
    "umount2": "/merged, flags: 0x2: operation not permitted",  # umount ...
    "chroot": 'chrooting to directory "',
    "pivot_root": "pivot_root .: operation not permitted",
    "sethostname": "sethostname: operation not permitted",
    "setns": "cannot set user namespace",
    "enosys-keyctl": "unable to join session keyring",
}


def test_the_list_covers_every_addition() -> None:
    preset = profiles.PRESETS[profile_of(CONTAINER)]
    assert set(NEEDED) == {*preset.syscalls, *(f"namespace-{n}" for n in preset.new_namespaces),
                           *(f"enosys-{c}" for c in preset.enosys)}


@pytest.mark.parametrize("name", sorted(NEEDED))
def test_each_addition_is_needed(context: Path, runc: oci.Runc, name: str) -> None:
    """What the preset allows beyond the runtime default, one item at a time: without it
    the example's script fails, with that item's error."""
    container = builder(runc, context, seccomp.build(without(name)))
    result = build(container)
    print(f"\n[without {name}] rc={result.returncode}: {result.output[-1500:]}")
    assert result.returncode != 0
    assert NEEDED[name] in result.output
    assert "RAN podman:" not in result.output
