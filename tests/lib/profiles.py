"""Seccomp profiles and capabilities for the containers, from the project's generator:
the profile a node gets (``fuse-device-plugin profile seccomp --preset P``, the same text
as ``fuse_plugin.profiles.render_seccomp``), and each preset's capabilities and extra
system calls (``fuse_plugin.profiles.presets``).

``runtime_default()`` is what a tenant's pod runs under when it asks for nothing: the
real runtime-default rules (Debian containers-common's seccomp.json, converted for this
machine and the pod's capabilities by tests/lib/runtime_default.py), not a list
of our own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from functools import cache

from fuse_plugin.profiles import presets
from tests.lib import runtime_default as converter
from tests.lib import runtimes

PRESETS = tuple(presets.PRESETS)
# The chosen runtime's default bounding set (containerd's unless FUSE_E2E_RUNTIME=crio),
# the one a pod without capability additions gets.
DEFAULT_CAPS = runtimes.default_capabilities()


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


def without_additions(preset: str) -> str:
    """The preset's generated profile minus what any preset adds to the runtime's
    allow-list (mount, umount2, unshare, setns, pivot_root, chroot): the control that
    shows those additions are what let a FUSE mount through our profile."""
    profile = json.loads(seccomp(preset))
    extras = {name for other in PRESETS for name in extra_syscalls(other)}
    for rule in profile["syscalls"]:
        if rule.get("action") == "SCMP_ACT_ALLOW":
            rule["names"] = [n for n in rule["names"] if n not in extras]
    profile["syscalls"] = [r for r in profile["syscalls"] if r["names"]]
    return json.dumps(profile)


def runtime_default(capabilities: Iterable[str] = DEFAULT_CAPS) -> str:
    """The runtime-default profile as OCI JSON text, for a container whose bounding set is
    ``capabilities`` (the chosen runtime's default set unless given), from that
    runtime's rules (tests/lib/runtimes.py): hostile tests attack with exactly what a
    tenant has. Fails when the rules' file is missing."""
    return _runtime_default(frozenset(capabilities))


@cache
def _runtime_default(capabilities: frozenset[str]) -> str:
    return json.dumps(converter.resolve(converter.convert(
        runtimes.seccomp_source(), capabilities, converter.this_host())))
