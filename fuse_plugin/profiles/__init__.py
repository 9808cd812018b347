"""Least-privilege AppArmor and seccomp profiles for FUSE workloads: the container
runtime's default plus exactly what one preset needs (``presets``), rendered for AppArmor
(``apparmor``) and seccomp (``seccomp``), checked (``lint``), admitted and installed on a
node (``admit``, ``install``). What each preset grants, and why, is in docs/profiles.md.

Naming, relied on by the manifests and the node stages: the AppArmor profile is
``fuse-device-plugin-<preset>``; the seccomp profile is ``<preset>.json`` under the
kubelet's seccomp root in ``SECCOMP_SUBDIR`` (``localhostProfile:
fuse-device-plugin/<preset>.json``).
"""

from __future__ import annotations

from pathlib import Path

from fuse_plugin import files
from fuse_plugin.profiles import apparmor, seccomp
from fuse_plugin.profiles.presets import (
    PRESETS,
    SECCOMP_SUBDIR,
    Preset,
    apparmor_name,
    seccomp_file,
)
from fuse_plugin.profiles.validate import ProfileError

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
