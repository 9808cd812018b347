"""Least-privilege AppArmor and seccomp profiles for FUSE workloads.

/dev/fuse alone does not let a container mount: it also needs CAP_SYS_ADMIN, the
``mount``/``umount2`` system calls (refused by the runtime's default seccomp profile
without CAP_SYS_ADMIN) and an AppArmor profile without the runtime default's
``deny mount,``. The usual fix is ``privileged: true`` or ``Unconfined``; these profiles
are the narrow alternative: the runtime default, plus exactly what each preset needs.

What each preset grants beyond the runtime default (``RuntimeDefault``):

``s3fs`` (fstype ``fuse.s3fs``), ``sshfs`` (``fuse.sshfs``), ``generic`` (``fuse.*``)
    Capabilities to add in the pod: ``SYS_ADMIN``.
    Seccomp: ``mount``, ``umount2``. clone() still may not create namespaces and clone3
    still answers ENOSYS, so ``unshare``/``setns``/``pivot_root`` stay refused.
    AppArmor: ``mount fstype=<type> options=(rw|ro,nosuid,nodev[,noexec][,noatime])
    -> <mountpoint>`` for the preset's type and plain ``fuse`` (libfuse's fallback when
    the kernel refuses a subtype), ``umount <mountpoint>``; the runtime default's bare
    ``deny mount,`` is gone, ``deny mount fstype=fuseblk`` and "no mount or umount on
    /proc, /sys, /dev" are added. Mountpoint: ``--mountpoint`` (default anywhere else).
``lxcfs`` (``fuse.lxcfs``), necessarily broader
    Capabilities: ``SYS_ADMIN``, ``SYS_CHROOT``.
    Seccomp: ``mount``, ``umount2``, ``unshare``, ``setns``, ``pivot_root``, ``chroot``,
    and clone/clone3 with namespace flags.
    AppArmor: the FUSE rules at /var/lib/lxcfs, and for its private mount namespace:
    make / rprivate, tmpfs on /run/lxcfs/controllers, cgroup and cgroup2 below it, bind
    mounts of / and /run into /run/lxcfs/root, a move of the controllers there,
    ``pivot_root /run/lxcfs/root/``, unmounting / (the old root) and the controllers.

Seccomp cannot see a filesystem type: with CAP_SYS_ADMIN and ``mount`` allowed, only the
AppArmor profile keeps a container from mounting proc, cgroup or tmpfs, so on nodes
without AppArmor (SELinux distributions) the FUSE presets confine less; see
docs/profiles.md.

Naming, relied on by the manifests and the node stages: the AppArmor profile is
``fuse-device-plugin-<preset>`` in a file of that name in the AppArmor directory; the
seccomp profile is ``<preset>.json`` under ``/var/lib/kubelet/seccomp/fuse-device-plugin``
(``localhostProfile: fuse-device-plugin/<preset>.json``).
"""

from __future__ import annotations

from pathlib import Path

from fuse_plugin import files
from fuse_plugin.profiles import apparmor, seccomp
from fuse_plugin.profiles.presets import PRESETS, Preset, apparmor_name, seccomp_file
from fuse_plugin.profiles.validate import ProfileError

SECCOMP_SUBDIR = "fuse-device-plugin"

__all__ = [
    "PRESETS",
    "SECCOMP_SUBDIR",
    "Preset",
    "ProfileError",
    "apparmor_name",
    "render_apparmor",
    "render_seccomp",
    "seccomp_file",
    "seccomp_localhost_profile",
    "write_all",
]


def render_apparmor(preset: str, name: str | None = None, mountpoint: str | None = None
                    ) -> str:
    """The AppArmor profile text for ``preset`` (ProfileError on a bad name or glob)."""
    return apparmor.render(preset, name, mountpoint)


def render_seccomp(preset: str) -> str:
    """The seccomp profile for ``preset`` as OCI JSON text."""
    return seccomp.render(preset)


def seccomp_localhost_profile(preset: str) -> str:
    """``securityContext.seccompProfile.localhostProfile`` for a preset."""
    return f"{SECCOMP_SUBDIR}/{seccomp_file(preset)}"


def write_all(directory: Path) -> list[Path]:
    """Write every preset's AppArmor and seccomp profile into ``directory``.

    The layout is the installer's ``--source``: ``fuse-device-plugin-<preset>`` (AppArmor)
    and ``<preset>.json`` (seccomp), so the result can become the ConfigMap as is.
    """
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for preset in PRESETS:
        for path, text in (
            (directory / apparmor_name(preset), render_apparmor(preset)),
            (directory / seccomp_file(preset), render_seccomp(preset)),
        ):
            files.write_atomic(path, text.encode())
            written.append(path)
    return written
