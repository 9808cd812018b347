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
fuse-overlayfs, with the pod's /dev/fuse, where it cannot).

More than one uid (issue 48): manifests/examples/rootless-build-users/ the same way. Its
Containerfile makes a user (1001), chowns its files to it and switches to it with USER;
uid 1000 (no capability in effect; SETUID and SETGID added to its bounding set, privilege
escalation allowed) has the image's newuidmap and newgidmap map /etc/subuid's and
/etc/subgid's ranges, and both images run as that user. The controls take each addition
away: the build then maps one uid and the Containerfile's chown fails with issue 48's
error, as it does in the first example's pod.

What differs from a node: the image is this machine's /usr (its buildah 1.28, podman 4.3,
runc 1.1, and Debian 12's newuidmap and newgidmap, as in the example's image), with the
image's newuidmap and newgidmap as a node shows them (owned by the pod's root, with the
file capabilities the example's Dockerfile gives them: ``id_mappers``) bound over its own,
for both examples; and no AppArmor (this kernel has none).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterator, Sequence
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


CAP_SETGID, CAP_SETUID = 6, 7
# struct vfs_ns_cap_data (linux/capability.h): a version 3 file capability, effective,
# one permitted capability, and the user namespace root it belongs to.
VFS_CAP_REVISION_3, VFS_CAP_FLAGS_EFFECTIVE = 0x03000000, 0x000001


def id_mappers(runc: oci.Runc, how: str = "file-capability") -> list[oci.Bind]:
    """The image's newuidmap and newgidmap as a user-namespaced pod sees them on a node,
    bound over the stand-in image's: owned by the pod's root (the runtime shows the
    image's root files through an idmapped mount), with the file capability
    manifests/examples/rootless-build/Dockerfile gives each (``file-capability``: cap_setuid,
    cap_setgid, effective, for the pod's root: what the kernel makes of the image's
    capability there) or set-uid root as Debian ships them (``set-uid``). The programs
    are this machine's, Debian 12's uidmap, as in the image."""
    directory = runc.base / f"image-{how}"
    directory.mkdir(mode=0o755, exist_ok=True)
    binds = []
    for tool, cap in (("newuidmap", CAP_SETUID), ("newgidmap", CAP_SETGID)):
        mapper = directory / tool
        binds.append(oci.Bind(mapper, f"/usr/bin/{tool}", readonly=True))
        if mapper.exists():
            continue
        shutil.copyfile(Path("/usr/bin") / tool, mapper)
        # The owner before the mode and the capability: chown clears both.
        os.chown(mapper, oci.USERNS_HOST_ID, oci.USERNS_HOST_ID)
        if how == "set-uid":
            mapper.chmod(0o4755)
        else:
            assert how == "file-capability"
            mapper.chmod(0o755)
            os.setxattr(mapper, "security.capability", struct.pack(
                "<6I", VFS_CAP_REVISION_3 | VFS_CAP_FLAGS_EFFECTIVE, 1 << cap, 0, 0, 0,
                oci.USERNS_HOST_ID))
    return binds


def builder(runc: oci.Runc, context: Path, profile: str | dict[str, object], *,
            pod: Doc = POD, security: Doc | None = None, proc_unmasked: bool = True,
            cgroup2: Path | None = None, allocation: api.ContainerAllocateResponse | None = None,
            image: Sequence[oci.Bind] | None = None) -> oci.RuncContainer:
    """An example's container (``pod``'s one): its uid, capabilities, privilege
    escalation, procMount, environment and volumes (a ConfigMap's ``subPath`` as that
    file), with the given seccomp profile; ``security`` instead of its securityContext;
    ``cgroup2`` is bound over /sys/fs/cgroup, read-only; ``allocation`` is the plugin's
    answer for a container that also asks for ``github.com/fuse``; ``image`` are files
    bound over the stand-in image's, by default the example image's newuidmap and
    newgidmap (``id_mappers``)."""
    [container] = containers(pod)
    sc = container["securityContext"] if security is None else security
    volumes = {v["name"]: v for v in pod_spec(pod)["volumes"]}
    binds = [oci.Bind(context / m.get("subPath", ""), m["mountPath"], readonly=True)
             if "configMap" in volumes[m["name"]] else
             oci.Bind(empty_dir(runc.base / m["name"]), m["mountPath"])
             for m in container["volumeMounts"]]
    request = oci.ContainerRequest(
        args=["sleep", "infinity"], allocation=allocation,
        user=(sc["runAsUser"], sc["runAsGroup"]),
        host_users=pod_spec(pod)["hostUsers"], drop_capabilities=tuple(
            sc["capabilities"]["drop"]), add_capabilities=tuple(
            f"CAP_{c}" for c in sc["capabilities"].get("add", [])),
        no_new_privileges=not sc["allowPrivilegeEscalation"], seccomp=profile,
        proc_unmasked=proc_unmasked, readonly_rootfs=sc["readOnlyRootFilesystem"],
        host_network=False, env={e["name"]: e["value"] for e in container["env"]},
        binds=[*binds, *(id_mappers(runc) if image is None else image)])
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


# buildah 1.28 shows its copier subprocess's error only when it has read the subprocess's
# stderr before the end of its stdout (copier.go: `errors.Is(err, io.EOF) &&
# errorBuffer.Len() > 0`). On a loaded machine it sometimes has not, and the chroot that
# failed reads as this instead, at the first step that copies (seen once in 4 runs).
COPIER_EOF = {"chroot": 'building at STEP "ADD rootfs.tar /": checking on sources under '
                        '"/var/lib/build/tmp/base": error decoding response from copier '
                        "subprocess: EOF"}


@pytest.mark.parametrize("name", sorted(NEEDED))
def test_each_addition_is_needed(context: Path, runc: oci.Runc, name: str) -> None:
    """What the preset allows beyond the runtime default, one item at a time: without it
    the example's script fails, with that item's error."""
    container = builder(runc, context, seccomp.build(without(name)))
    result = build(container)
    print(f"\n[without {name}] rc={result.returncode}: {result.output[-1500:]}")
    assert result.returncode != 0
    assert NEEDED[name] in result.output or COPIER_EOF.get(name, NEEDED[name]) in result.output
    assert "RAN podman:" not in result.output


# -- more than one uid: manifests/examples/rootless-build-users/ (issue 48) ----------------

USERS_EXAMPLE = EXAMPLES / "rootless-build-users" / "build-pod.yaml"
USERS_POD = one(USERS_EXAMPLE, "Pod")
USERS_CONFIGMAP = one(USERS_EXAMPLE, "ConfigMap")
[USERS_CONTAINER] = containers(USERS_POD)
# What each image's CMD prints, as the script's `RAN` lines join it: the uid and name it
# runs as (the Containerfile's USER), the owner of a file a RUN step wrote as that user
# and of one COPY --chown gave it, and that file.
USERS_OUTPUT = "1001 app app:app app:app written by app "
# The one-uid error of issue 48: the Containerfile's chown when the build maps one uid.
ONE_UID = "chown: /home/app: Invalid argument"
# The build's ids (buildah unshare's uid_map and gid_map): uid 1000 as its root, then
# /etc/subuid's ranges. The pod's root is not among them.
BUILD_MAP = [["0", "1000", "1"], ["1", "1", "999"], ["1000", "1001", "64535"]]
USERS_FACTS = """
echo "CAPS $(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)"
echo "BOUND $(sed -n 's/^CapBnd:[[:space:]]*//p' /proc/self/status)"
echo "BUILD_UIDMAP $(buildah unshare cat /proc/self/uid_map | tr -s ' \\n' ' ')"
echo "BUILD_GIDMAP $(buildah unshare cat /proc/self/gid_map | tr -s ' \\n' ' ')"
"""


@pytest.fixture(scope="module")
def users_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("buildah", "podman", "runc", "busybox", "newuidmap", "newgidmap"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: scripts/install --dev installs it from "
                        "scripts/apt-packages.txt")
    return configmap_volume(tmp_path_factory.mktemp("configmap-users"),
                            USERS_CONFIGMAP["data"])


def users_build(runc: oci.Runc, context: Path, *, pod: Doc = USERS_POD,
                security: Doc | None = None, how: str = "file-capability",
                cgroup2: Path | None = None, then: str = "") -> oci.Result:
    container = builder(runc, context, profiles.render_seccomp(profile_of(USERS_CONTAINER)),
                        pod=pod, security=security, cgroup2=cgroup2,
                        image=id_mappers(runc, how))
    return build(container, then)


def test_users_example_runs_its_script_under_the_same_profiles_and_image() -> None:
    """The second example differs from the first only where issue 48 needs it."""
    assert USERS_CONTAINER["command"] == CONTAINER["command"]
    assert USERS_CONTAINER["image"] == CONTAINER["image"]
    ours, theirs = USERS_CONTAINER["securityContext"], CONTAINER["securityContext"]
    assert {k: v for k, v in ours.items() if v != theirs.get(k)} == {
        "allowPrivilegeEscalation": True,
        "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID"]}}
    assert set(ours) == set(theirs)
    mounts = {m["mountPath"]: m.get("subPath") for m in USERS_CONTAINER["volumeMounts"]}
    assert mounts["/etc/subuid"] == "subuid"
    assert mounts["/etc/subgid"] == "subgid"


@pytest.mark.parametrize("cgroups", ["this-machine", "v2"])
def test_buildah_and_podman_build_an_image_with_a_user_of_its_own_and_run_it_as_that_user(
        users_context: Path, runc: oci.Runc, request: pytest.FixtureRequest,
        cgroups: str) -> None:
    """The Containerfile adds a user (1001), chowns its files to it, COPYs with
    --chown, switches to it with USER and writes a file as it; each tool builds it and
    the image runs as that user. uid 1000 holds no capability itself; the build's ids are
    uid 1000 and the subordinate ranges inside the pod's, never the pod's root."""
    hierarchy = request.getfixturevalue("cgroup2") if cgroups == "v2" else None
    result = users_build(runc, users_context, cgroup2=hierarchy, then=USERS_FACTS)
    print(f"\n[more than one uid] rc={result.returncode}\n{result.stdout[-4000:]}"
          f"\n{result.stderr[-2000:]}")
    result.check()
    out = result.stdout
    for step in ("STEP 2/6: RUN echo 'app:x:1001:1001::/home/app:/bin/sh' >> /etc/passwd",
                 "STEP 3/6: COPY --chown=app:app hello.txt /home/app/hello.txt",
                 "STEP 4/6: USER app",
                 'STEP 5/6: RUN echo "written by $(id -un)" > /data/note.txt'):
        assert sum(line.startswith(step) for line in out.splitlines()) == 2, step
    assert tagged(out, "RAN buildah:") == USERS_OUTPUT
    assert tagged(out, "RAN podman:") == USERS_OUTPUT
    assert "Falling back to single mapping" not in result.output
    # No capability in effect; SETUID and SETGID only bound what newuidmap may gain.
    assert tagged(out, "CAPS") == "0000000000000000"
    assert int(tagged(out, "BOUND"), 16) == 1 << CAP_SETUID | 1 << CAP_SETGID
    for tag in ("BUILD_UIDMAP", "BUILD_GIDMAP"):
        assert tagged(out, tag).split() == [i for line in BUILD_MAP for i in line], tag
    # On the node, the file the image's user wrote belongs to the pod's uid 1002 (the
    # build's 1001): one of the pod's ids, not the pod's root and not a node's user.
    notes = list((runc.base / "build" / "storage" / "overlay").glob("*/diff/data/note.txt"))
    assert notes
    assert {note.stat().st_uid for note in notes} == {oci.USERNS_HOST_ID + 1002}


# Each thing the second example adds, taken away, and what buildah or newuidmap then
# says; buildah maps one uid instead and the Containerfile's chown fails (issue 48).
NO_RANGES = "Found no UID ranges set aside for user"
WITHOUT = {
    # The first example's pod and security context as they are.
    "one-uid-example": NO_RANGES,
    "subordinate-ids": NO_RANGES,
    "privilege-escalation": "newuidmap: write to uid_map failed: Operation not permitted",
    # A file capability beyond the bounding set: the kernel refuses the exec itself.
    "capabilities": "fork/exec /usr/bin/newuidmap: operation not permitted",
    # Debian's set-uid root newuidmap: the pod's root, without CAP_DAC_OVERRIDE.
    "file-capability": "newuidmap: open of uid_map failed: Permission denied",
}


@pytest.mark.parametrize("name", sorted(WITHOUT))
def test_without_each_addition_the_build_maps_one_uid_and_the_chown_fails(
        users_context: Path, runc: oci.Runc, name: str) -> None:
    pod, security, how = USERS_POD, None, "file-capability"
    if name == "one-uid-example":
        pod = POD
    elif name == "privilege-escalation":
        security = {**USERS_CONTAINER["securityContext"], "allowPrivilegeEscalation": False}
    elif name == "capabilities":
        security = {**USERS_CONTAINER["securityContext"], "capabilities": {"drop": ["ALL"]}}
    elif name == "subordinate-ids":
        pod = copy.deepcopy(USERS_POD)
        [container] = containers(pod)
        container["volumeMounts"] = [m for m in container["volumeMounts"]
                                     if "subPath" not in m]
    else:
        how = "set-uid"
    result = users_build(runc, users_context, pod=pod, security=security, how=how)
    print(f"\n[without {name}] rc={result.returncode}: {result.output[-1500:]}")
    assert result.returncode != 0
    assert "Successfully tagged localhost/base:latest" in result.output
    assert 'Error: building at STEP "RUN echo \'app:x:1001:1001' in result.output
    assert ONE_UID in result.output
    assert WITHOUT[name] in result.output
    assert "RAN buildah:" not in result.output


@pytest.mark.usefixtures("users_context")
def test_a_range_with_the_pods_root_is_refused_by_the_kernel(
        tmp_path: Path, runc: oci.Runc) -> None:
    """Whoever writes the ConfigMap cannot map the pod's root into the build: a map that
    names the parent's uid 0 needs CAP_SETFCAP (Linux 5.12+), which the pod does not
    add, so newuidmap is refused even for a range /etc/subuid lists, and the build maps
    one uid."""
    data = {**USERS_CONFIGMAP["data"], "subuid": "1000:0:1000\n1000:1001:64535\n"}
    assert data["subuid"] != USERS_CONFIGMAP["data"]["subuid"]
    (tmp_path / "configmap").mkdir()
    volume = configmap_volume(tmp_path / "configmap", data)
    result = users_build(runc, volume)
    print(f"\n[the pod's root in /etc/subuid] rc={result.returncode}: {result.output[-1500:]}")
    assert result.returncode != 0
    assert "newuidmap: write to uid_map failed: Operation not permitted" in result.output
    assert ONE_UID in result.output
    assert "RAN buildah:" not in result.output
