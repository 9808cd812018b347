"""The presets as data: what each kind of FUSE workload is granted beyond the runtime default.

Everything the renderers emit that is not the runtime default comes from here, so the
difference between a preset and ``RuntimeDefault`` can be read in one screen and is the
same list the docs, the tests and the closing notes quote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Mount flags every FUSE rule requires: set-uid files and device nodes on a filesystem
# served by the container itself would be a way out. fusermount3 adds both always.
FUSE_REQUIRED_FLAGS = ("nosuid", "nodev")
# Flags FUSE programs add on request (`-o ro`, `-o noexec`, `-o noatime`). AppArmor's
# `options=(...)` matches the flag set exactly, so each combination is its own rule.
FUSE_OPTIONAL_FLAGS = ("ro", "noexec", "noatime")


@dataclass(frozen=True)
class Preset:
    """One workload kind. ``capabilities`` go to ``securityContext.capabilities.add``."""

    name: str
    summary: str
    capabilities: tuple[str, ...]
    # Allowed on top of the runtime default's allow-list (seccomp).
    syscalls: tuple[str, ...]
    # FUSE filesystem types the AppArmor profile may mount (AppArmor globs).
    fuse_fstypes: tuple[str, ...]
    # Where those mounts may go when no --mountpoint is given.
    default_mountpoint: str = "/**"
    # lxcfs builds its own mount namespace: clone/clone3 with namespace flags allowed.
    namespaces: bool = False
    # Further AppArmor rules (mounts that are not FUSE, pivot_root); lxcfs only.
    extra_apparmor: tuple[str, ...] = ()
    # Other unmounts the program performs besides its own FUSE mountpoint.
    extra_umounts: tuple[str, ...] = ()
    # Files directly in /proc the workload may bind over from the same name under
    # <mountpoint>/proc/ (lxcfs's files); every other mount on /proc stays denied.
    proc_binds: tuple[str, ...] = ()
    # Namespaces clone() and unshare() may create (keys of NAMESPACE_FLAGS), each call's
    # flags checked by seccomp; the others stay refused. lxcfs's ``namespaces`` instead
    # lets clone/clone3 through unchecked.
    new_namespaces: tuple[str, ...] = ()
    # Answered ENOSYS ("not here") instead of the default EPERM, for programs that carry on
    # without the call only then; still refused.
    enosys: tuple[str, ...] = ()
    # The program runs containers of its own, in user namespaces of its own (rootless
    # builds): the AppArmor profile then allows their mounts (``extra_apparmor``) and does
    # not deny mounts on /proc, /sys and /dev, where their runtime masks each container's
    # own /proc and /sys after pivot_root. The kernel bounds those mounts (docs/profiles.md).
    nested_containers: bool = False


_FUSE_SYSCALLS = ("mount", "umount2")

# lxcfs 5 at start-up (runtime dir /run): unshares a mount namespace, makes / rprivate,
# mounts a tmpfs on /run/lxcfs/controllers and the cgroup hierarchies beneath it,
# bind-mounts / and /run into /run/lxcfs/root, moves the controllers there, pivots into
# it and detaches the old root; then setns() back to serve FUSE from the first namespace.
# No "rw" in these options: AppArmor 3.0's parser (Debian 12, Ubuntu 22.04) turns
# `options=(rw,bind)` into the bind AND any mount of any type without flags at the same
# place (a fresh, unmasked procfs, say); the kernel ignores rw for binds, moves and
# propagation changes anyway, so the bare keyword allows exactly the same calls.
_LXCFS_RULES = (
    "mount options=(rprivate) -> /,",
    "mount fstype=tmpfs -> /run/lxcfs/controllers/,",
    "mount fstype=cgroup -> /run/lxcfs/controllers/**,",
    "mount fstype=cgroup2 -> /run/lxcfs/controllers/**,",
    "mount options=(bind) / -> /run/lxcfs/root/,",
    "mount options=(bind) /run/ -> /run/lxcfs/root/run/,",
    "mount options=(move) /run/lxcfs/controllers/ -> /run/lxcfs/root/run/lxcfs/controllers/,",
    "pivot_root /run/lxcfs/root/,",
)
# What lxcfs serves that a workload binds over its own /proc, in a child mount namespace
# (manifests/examples/lxcfs-daemonset.yaml; tests/unit/test_manifests.py keeps the two equal).
LXCFS_PROC_FILES = ("cpuinfo", "diskstats", "loadavg", "meminfo", "stat", "swaps", "uptime")

# CLONE_NEW* (linux/sched.h) by namespace. CLONE_NEWTIME shares its bit with clone()'s
# exit signal, so only unshare() can name it.
NAMESPACE_FLAGS = {
    "time": 0x00000080, "mount": 0x00020000, "cgroup": 0x02000000, "uts": 0x04000000,
    "ipc": 0x08000000, "user": 0x10000000, "pid": 0x20000000, "net": 0x40000000,
}


def namespace_flags(names: tuple[str, ...]) -> int:
    flags = 0
    for name in names:
        flags |= NAMESPACE_FLAGS[name]
    return flags


# rootless-build: buildah and podman as a non-root uid of a `hostUsers: false` pod, building
# with the kernel's overlay in user namespaces of their own (docs/profiles.md). Traced with
# strace (buildah 1.28, podman 4.3, runc 1.1; tests/containers/test_rootless_build.py):
# - unshare/clone of a user namespace (buildah and podman re-execute themselves in one),
#   then mount, UTS, IPC and PID namespaces (runc's container for a RUN step). Never a
#   network namespace (`--network host`: RUN uses the pod's), a cgroup one (`--cgroupns
#   host`, which cgroup v2 nodes need: a cgroup namespace and a v1 mount were
#   CVE-2022-0492's way out) or a time one;
# - mount/umount2: the overlay layer stacks, runc's /proc, /dev, binds and masks;
# - pivot_root: runc's root, and containers/storage applying a layer;
# - chroot: buildah's COPY and layer copies chroot into the image's root (the runtime
#   default allows chroot only with CAP_SYS_CHROOT in the pod, which this pod drops);
# - sethostname: runc names the RUN step's UTS namespace;
# - setns: podman's later commands join the user and mount namespace its pause process
#   keeps.
# keyctl answers ENOSYS: runc (podman run) joins a new session keyring unless the call is
# missing, and the keyrings are not per container, so it stays refused.
_BUILD_NAMESPACES = ("user", "mount", "uts", "ipc", "pid")
# AppArmor: the mounts those namespaces hold, by filesystem type (the paths depend on the
# storage directory and, after pivot_root, on the build container's root, so they are
# not narrowed). Options as AppArmor compares them: a bind's and a propagation change's
# only flags are bind/rec and the propagation type (the kernel drops the others first).
ROOTLESS_BUILD_RULES = (
    "mount fstype=overlay -> /**,",
    "mount fstype=proc options=(rw,nosuid,nodev,noexec) -> /**,",
    "mount fstype=tmpfs -> /**,",
    "mount fstype=devpts options=(rw,nosuid,noexec) -> /**,",
    "mount fstype=mqueue options=(rw,nosuid,nodev,noexec) -> /**,",
    "mount options=(bind) -> /**,",
    "mount options=(rbind) -> /**,",
    "mount options=(private) -> /{,**},",
    "mount options=(rprivate) -> /{,**},",
    "mount options=(rslave) -> /{,**},",
    "mount options=(remount,bind,ro) -> /**,",
    "mount options=(remount,bind,ro,nosuid,nodev,noexec) -> /**,",
    "mount options=(remount,rbind,ro,nosuid,nodev,noexec) -> /**,",
    "mount options=(remount,bind,nosuid,nodev,noexec) -> /**,",
    "pivot_root /**,",
)

PRESETS: dict[str, Preset] = {
    preset.name: preset for preset in (
        Preset(
            name="s3fs",
            summary="s3fs-fuse: an S3 bucket as a filesystem (libfuse 2, fstype fuse.s3fs)",
            capabilities=("SYS_ADMIN",),
            syscalls=_FUSE_SYSCALLS,
            fuse_fstypes=("fuse.s3fs", "fuse"),
        ),
        Preset(
            name="sshfs",
            summary="sshfs: a remote directory over SSH (libfuse 3, fstype fuse.sshfs)",
            capabilities=("SYS_ADMIN",),
            syscalls=_FUSE_SYSCALLS,
            fuse_fstypes=("fuse.sshfs", "fuse"),
        ),
        Preset(
            name="generic",
            summary="any FUSE filesystem (rclone, gcsfuse, squashfuse, ...): fstype fuse.*",
            capabilities=("SYS_ADMIN",),
            syscalls=_FUSE_SYSCALLS,
            fuse_fstypes=("fuse.*", "fuse"),
        ),
        Preset(
            name="lxcfs",
            summary="lxcfs 5: broader - its own mount namespace, tmpfs and cgroup mounts, "
                    "bind and move mounts, pivot_root, its files bound over /proc",
            capabilities=("SYS_ADMIN", "SYS_CHROOT"),
            syscalls=("mount", "umount2", "unshare", "setns", "pivot_root", "chroot"),
            fuse_fstypes=("fuse.lxcfs", "fuse"),
            default_mountpoint="/var/lib/lxcfs",
            namespaces=True,
            extra_apparmor=_LXCFS_RULES,
            extra_umounts=("/", "/run/lxcfs/controllers/"),
            proc_binds=LXCFS_PROC_FILES,
        ),
        Preset(
            name="rootless-build",
            summary="buildah/podman as a non-root user of a hostUsers: false pod: user, "
                    "mount, UTS, IPC and PID namespaces of its own, overlay, RUN steps; "
                    "never for hostUsers: true pods",
            capabilities=(),
            syscalls=("mount", "umount2", "pivot_root", "chroot", "sethostname", "setns"),
            fuse_fstypes=("fuse.fuse-overlayfs", "fuse"),
            new_namespaces=_BUILD_NAMESPACES,
            enosys=("keyctl",),
            extra_apparmor=ROOTLESS_BUILD_RULES,
            nested_containers=True,
        ),
    )
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        from fuse_plugin.profiles.validate import ProfileError
        raise ProfileError(
            f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}") from None


# Where install-profiles puts the seccomp files: pods name them relative to the kubelet's
# seccomp root, as `fuse-device-plugin/<preset>.json`.
SECCOMP_SUBDIR = "fuse-device-plugin"
DEFAULT_SECCOMP_DIR = Path("/var/lib/kubelet/seccomp") / SECCOMP_SUBDIR


def apparmor_name(preset: str) -> str:
    """The default AppArmor profile name (others build manifests from it: keep it)."""
    return f"fuse-device-plugin-{preset}"


def seccomp_file(preset: str) -> str:
    """The seccomp file name, installed under <seccomp-dir>/ on the node."""
    return f"{preset}.json"
