"""Seccomp profiles and capabilities for the containers, from the project's generator:
the profile a node gets (``fuse-device-plugin profile seccomp --preset P``, the same text
as ``fuse_plugin.profiles.render_seccomp``), and each preset's capabilities and extra
system calls (``fuse_plugin.profiles.presets``).

``runtime_default()`` is the control: the generator's allow-list without any preset's
additions, i.e. what a pod gets from the runtime default (built from the ``generic``
profile, whose only additions are ``mount`` and ``umount2``, by removing them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

from fuse_plugin.profiles import presets

PRESETS = tuple(presets.PRESETS)


def capabilities(preset: str) -> tuple[str, ...]:
    """What the preset tells the pod to add (``securityContext.capabilities.add``), with
    the ``CAP_`` prefix the OCI config uses."""
    return tuple(f"CAP_{c}" for c in presets.get(preset).capabilities)


def extra_syscalls(preset: str) -> tuple[str, ...]:
    return presets.get(preset).syscalls


@cache
def seccomp(preset: str) -> str:
    """The preset's profile as OCI JSON text, as ``profile seccomp`` prints it."""
    result = subprocess.run(
        [sys.executable, "-m", "fuse_plugin", "profile", "seccomp", "--preset", preset],
        capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise AssertionError(f"profile seccomp --preset {preset} failed: {result.stderr}")
    return result.stdout


def runtime_default() -> str:
    """The generated allow-list minus every preset's additions (mount, umount2, unshare,
    setns, pivot_root, chroot): the runtime-default control."""
    profile = json.loads(seccomp("generic"))
    extras = {name for preset in PRESETS for name in extra_syscalls(preset)}
    for rule in profile["syscalls"]:
        if rule.get("action") == "SCMP_ACT_ALLOW":
            rule["names"] = [n for n in rule["names"] if n not in extras]
    profile["syscalls"] = [r for r in profile["syscalls"] if r["names"]]
    return json.dumps(profile)
