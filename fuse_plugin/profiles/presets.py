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
