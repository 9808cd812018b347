"""Seccomp profiles as plain OCI JSON: the runtime default plus exactly a preset's extras.

containerd reads a ``Localhost`` profile straight into the OCI ``LinuxSeccomp`` struct, so
Docker-style ``includes``/``excludes`` conditions (by capability, kernel, architecture)
are dropped without a word and every rule applies unconditionally. The runtime default
only allows mount/umount2/unshare/setns for CAP_SYS_ADMIN through such conditions; here
nothing is conditional: a preset lists what it allows, and everything else is refused
with EPERM (``SCMP_ACT_ERRNO``), like the runtime default.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from fuse_plugin.profiles import presets

# One file serves amd64 and arm64 nodes, with their 32-bit compat ABIs, as the runtime's
# default does; libseccomp ignores an architecture the kernel never reports.
ARCHITECTURES = (
    "SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32",
    "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM",
)
# personality(2) values the runtime default accepts: PER_LINUX, PER_LINUX with
# UNAME26 (0x0008), with ADDR_NO_RANDOMIZE (0x20000), both, and the query 0xffffffff.
PERSONALITIES = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)
# CLONE_NEWNS|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWCGROUP: clone() may not create
# namespaces unless the preset needs to (the runtime's rule for containers without
# CAP_SYS_ADMIN, which ours have).
CLONE_NAMESPACE_FLAGS = 0x7E020000
# The same for unshare(), which can also name CLONE_NEWTIME.
UNSHARE_NAMESPACE_FLAGS = CLONE_NAMESPACE_FLAGS | presets.NAMESPACE_FLAGS["time"]
ENOSYS = 38


def _flags_clear(name: str, refused: int) -> dict[str, Any]:
    """``name`` allowed when none of the ``refused`` bits is set in its first argument."""
    return {"names": [name], "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": refused, "valueTwo": 0,
                      "op": "SCMP_CMP_MASKED_EQ"}]}


def _names(resource: str) -> tuple[str, ...]:
    text = resources.files("fuse_plugin.profiles").joinpath(resource).read_text()
    names = []
    for line in text.splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.append(name)
    return tuple(names)


@cache
def runtime_default_syscalls() -> tuple[str, ...]:
    """The unconditional part of the runtime default allow-list (package data)."""
    return _names("runtime_default_syscalls.txt")


@cache
def known_syscalls() -> frozenset[str]:
    """Every system call name some Linux architecture has (for the lint)."""
    return frozenset(_names("known_syscalls.txt"))


def build(preset_name: str | presets.Preset) -> dict[str, Any]:
    """The profile as a dict in OCI ``LinuxSeccomp`` form (what ``render`` serialises).

    A ``Preset`` instead of a name builds that one (the tests' controls: a preset without
    some of what it adds)."""
    preset = presets.get(preset_name) if isinstance(preset_name, str) else preset_name
    base = set(runtime_default_syscalls())
    extras = [name for name in preset.syscalls if name not in base]
    syscalls: list[dict[str, Any]] = [
        {"names": sorted(base), "action": "SCMP_ACT_ALLOW"},
    ]
    syscalls += [
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": value, "op": "SCMP_CMP_EQ"}]}
        for value in PERSONALITIES
    ]
    if preset.namespaces:
        syscalls.append({"names": ["clone", "clone3"], "action": "SCMP_ACT_ALLOW"})
    else:
        # clone() may create only the preset's namespaces (none for the FUSE presets):
        # allowed when the flags it may not use are all clear.
        allowed = presets.namespace_flags(preset.new_namespaces)
        syscalls.append(_flags_clear("clone", CLONE_NAMESPACE_FLAGS & ~allowed))
        # ENOSYS, not EPERM: glibc then falls back to clone(), whose flags are checked
        # above (seccomp cannot look into clone3's argument struct).
        syscalls.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS})
        if preset.new_namespaces:
            syscalls.append(_flags_clear("unshare", UNSHARE_NAMESPACE_FLAGS & ~allowed))
    if extras:
        syscalls.append({"names": extras, "action": "SCMP_ACT_ALLOW"})
    if preset.enosys:
        syscalls.append({"names": list(preset.enosys), "action": "SCMP_ACT_ERRNO",
                         "errnoRet": ENOSYS})
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "architectures": list(ARCHITECTURES),
        "syscalls": syscalls,
    }


def render(preset_name: str) -> str:
    """The profile as JSON text, stable byte for byte (sorted names, fixed key order)."""
    return json.dumps(build(preset_name), indent=2) + "\n"
