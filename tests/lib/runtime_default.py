"""The runtime-default seccomp profile a tenant's container really gets on this machine.

Hostile tests must attack with what a tenant has, so the profile is not written here: it
is converted from the rules Debian's containers-common ships (``SOURCE``, package
``SOURCE_PACKAGE``), the one source. That file is in the Docker/containers format, which
no OCI runtime reads: rules carry ``includes``/``excludes`` conditions (capabilities,
architectures, kernel version), architectures come as an ``archMap``, errnos may be given
by name. The engine (podman, CRI-O, Docker) turns it into the OCI ``linux.seccomp``
object for one container before runc sees it, and runc hands that to libseccomp, which
has its own rule for two rules naming one system call. ``convert`` does the engine's
part, ``resolve`` libseccomp's, ``runtime_default`` both.

The semantics, taken from containers/common's and moby's conversion code (as facts):

- ``excludes.arches`` / ``includes.arches``: a rule is dropped when the machine's
  architecture (libseccomp's name: ``amd64``, ``arm64``, ...) is excluded, or when an
  include list does not name it.
- ``excludes.caps``: dropped when *any* listed capability is in the container's bounding
  set; ``includes.caps``: dropped unless *every* listed capability is.
- ``excludes.minKernel`` / ``includes.minKernel`` (moby; containers/common 0.50 does not
  know the key and would keep the rule): compared on major.minor of the running kernel;
  an include needs the kernel at least that new, an exclude drops the rule when it is.
- ``archMap``: the entry for the native architecture gives ``architectures`` (it and its
  sub-architectures); an architecture not in the map gives none (libseccomp then uses the
  native one only).
- ``errno``/``defaultErrno`` (a name) wins over ``errnoRet``/``defaultErrnoRet``.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path("/usr/share/containers/seccomp.json")
SOURCE_PACKAGE = "golang-github-containers-common"

# uname's machine -> (libseccomp's name for it, which `arches` filters use; its archMap key)
NATIVE_ARCHES = {
    "x86_64": ("amd64", "SCMP_ARCH_X86_64"),
    "aarch64": ("arm64", "SCMP_ARCH_AARCH64"),
    "s390x": ("s390x", "SCMP_ARCH_S390X"),
    "ppc64le": ("ppc64le", "SCMP_ARCH_PPC64LE"),
}
FILTER_KEYS = frozenset({"caps", "arches", "minKernel"})
# Top-level fields the OCI struct has besides the rules: only these reach the runtime.
PASSED_THROUGH = ("flags", "listenerPath", "listenerMetadata")
ERRNO_ACTIONS = frozenset({"SCMP_ACT_ERRNO", "SCMP_ACT_TRACE"})

KernelVersion = tuple[int, int]


class RuntimeDefaultError(Exception):
    """The source file is missing or says something this converter cannot honour."""


@dataclass(frozen=True)
class Host:
    """What the conversion depends on besides the capabilities."""

    arch: str          # libseccomp's name, as `arches` filters spell it
    seccomp_arch: str  # the archMap key, SCMP_ARCH_*
    kernel: KernelVersion


def parse_kernel(release: str) -> KernelVersion:
    """major.minor of a kernel release; the rest ("6.18.44-fc") is ignored, as moby
    compares only those two."""
    match = re.match(r"(\d+)\.(\d+)", release)
    if match is None:
        raise RuntimeDefaultError(f"cannot read a kernel version from {release!r}")
    return int(match.group(1)), int(match.group(2))


def this_host() -> Host:
    """The running machine: its architecture and kernel decide which rules apply."""
    uname = os.uname()
    if uname.machine not in NATIVE_ARCHES:
        raise RuntimeDefaultError(f"no libseccomp architecture known for {uname.machine}")
    arch, seccomp_arch = NATIVE_ARCHES[uname.machine]
    return Host(arch, seccomp_arch, parse_kernel(uname.release))


def read_source(path: Path = SOURCE) -> dict[str, Any]:
    """The shipped profile; its absence is an error, never a silent fallback, since any
    stand-in would attack with rules no real tenant has."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RuntimeDefaultError(
            f"{path} is missing: the runtime-default seccomp profile is converted from it. "
            f"Install Debian package {SOURCE_PACKAGE} (scripts/apt-packages.txt lists "
            "it).") from None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise RuntimeDefaultError(f"{path} is not a JSON object")
    return data


def errno_number(name: str | None, number: int | None) -> int | None:
    """The errno a rule returns: a name (``"ENOSYS"``, or digits) wins over the number,
    as in containers/common; Python's errno module has the native architecture's
    values."""
    if not name:
        return number
    if name.isdigit():
        return int(name)
    value = getattr(errno, name, None)
    if not isinstance(value, int):
        raise RuntimeDefaultError(f"unknown errno {name!r}")
    return value


def _filters(rule: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    includes: dict[str, Any] = rule.get("includes") or {}
    excludes: dict[str, Any] = rule.get("excludes") or {}
    unknown = (includes.keys() | excludes.keys()) - FILTER_KEYS
    if unknown:
        # A new condition honoured by nobody here would make the rule apply everywhere.
        raise RuntimeDefaultError(f"unknown includes/excludes keys {sorted(unknown)} in "
                                  f"the rule for {rule.get('names') or rule.get('name')}")
    return includes, excludes


def applies(rule: Mapping[str, Any], capabilities: frozenset[str], host: Host) -> bool:
    """Whether the engine keeps ``rule`` for a container with this bounding set."""
    includes, excludes = _filters(rule)
    if host.arch in (excludes.get("arches") or ()):
        return False
    if any(cap in capabilities for cap in excludes.get("caps") or ()):
        return False
    if excludes.get("minKernel") and host.kernel >= parse_kernel(excludes["minKernel"]):
        return False
    if includes.get("arches") and host.arch not in includes["arches"]:
        return False
    if not all(cap in capabilities for cap in includes.get("caps") or ()):
        return False
    return not (includes.get("minKernel")
                and host.kernel < parse_kernel(includes["minKernel"]))


def oci_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    """One rule in the OCI shape: names, action, args (when any), errnoRet (when any)."""
    name, names = rule.get("name"), rule.get("names")
    if name and names:
        raise RuntimeDefaultError(f"a rule gives both name {name!r} and names")
    out: dict[str, Any] = {"names": [name] if name else list(names or []),
                           "action": rule["action"]}
    if rule.get("args"):
        out["args"] = [dict(arg) for arg in rule["args"]]
    ret = errno_number(rule.get("errno"), rule.get("errnoRet"))
    if ret is not None:
        out["errnoRet"] = ret
    return out


def architectures(source: Mapping[str, Any], host: Host) -> list[str]:
    """``architectures`` from a plain list, or from the archMap entry for this machine."""
    if source.get("architectures") and source.get("archMap"):
        raise RuntimeDefaultError("both architectures and archMap are given")
    if source.get("architectures"):
        return list(source["architectures"])
    for entry in source.get("archMap") or ():
        if entry["architecture"] == host.seccomp_arch:
            return [entry["architecture"], *(entry.get("subArchitectures") or ())]
    return []


def convert(source: Mapping[str, Any], capabilities: Iterable[str], host: Host
            ) -> dict[str, Any]:
    """The OCI ``linux.seccomp`` the engine hands the runtime for a container with this
    bounding set: applicable rules in the file's order, conditions gone."""
    caps = frozenset(capabilities)
    profile: dict[str, Any] = {"defaultAction": source["defaultAction"]}
    default_errno = errno_number(source.get("defaultErrno"), source.get("defaultErrnoRet"))
    if default_errno is not None:
        profile["defaultErrnoRet"] = default_errno
    arches = architectures(source, host)
    if arches:
        profile["architectures"] = arches
    profile.update({k: copy.deepcopy(source[k]) for k in PASSED_THROUGH if source.get(k)})
    profile["syscalls"] = [oci_rule(rule) for rule in source.get("syscalls") or ()
                           if applies(rule, caps, host)]
    return profile


def effective_action(action: str, ret: int | None) -> tuple[str, int | None]:
    """What runc makes of an action: ERRNO and TRACE without a number mean EPERM."""
    if action in ERRNO_ACTIONS:
        return action, errno.EPERM if ret is None else ret
    return action, None


def resolve(profile: Mapping[str, Any]) -> dict[str, Any]:
    """``profile`` with every rule name that runc and libseccomp ignore taken out, so the
    JSON says what the filter does.

    runc (1.1, libcontainer/seccomp) skips a rule whose action equals the default action,
    then adds the rest per name in order with ``seccomp_rule_add``. libseccomp (2.5,
    ``db_rule_add``) keeps the *first* unconditional rule for a system call and silently
    drops every later rule for it, whatever their action; an unconditional rule that comes
    after conditional ones replaces them. So where the file's unconditional allow list and
    a capability-dependent refusal both name ``setns``, the allow list, which comes first,
    wins: ``setns`` is allowed even without CAP_SYS_ADMIN.
    """
    default = effective_action(profile["defaultAction"], profile.get("defaultErrnoRet"))
    unconditional: set[str] = set()
    kept: list[tuple[dict[str, Any], list[str]]] = []
    for rule in profile["syscalls"]:
        if effective_action(rule["action"], rule.get("errnoRet")) == default:
            continue
        names: list[str] = []
        for name in rule["names"]:
            if name in unconditional:
                continue
            if not rule.get("args"):
                unconditional.add(name)
                for _, earlier in kept:
                    if name in earlier:
                        earlier.remove(name)
            names.append(name)
        kept.append((rule, names))
    out = {k: copy.deepcopy(v) for k, v in profile.items() if k != "syscalls"}
    out["syscalls"] = [{**copy.deepcopy(rule), "names": names}
                       for rule, names in kept if names]
    return out


def runtime_default(capabilities: Iterable[str], host: Host | None = None,
                    path: Path = SOURCE) -> dict[str, Any]:
    """The ``linux.seccomp`` a container with this bounding set runs under, on ``host``
    (this machine unless given)."""
    return resolve(convert(read_source(path), capabilities, host or this_host()))


def outcome(profile: Mapping[str, Any], name: str) -> tuple[str, int | None]:
    """How the resolved ``profile`` answers an argument-free call of ``name``: the action
    and errno of its unconditional rule, ``("conditional", None)`` when only rules with
    arguments name it, or the default."""
    conditional = False
    for rule in profile["syscalls"]:
        if name in rule["names"]:
            if not rule.get("args"):
                return effective_action(rule["action"], rule.get("errnoRet"))
            conditional = True
    if conditional:
        return "conditional", None
    return effective_action(profile["defaultAction"], profile.get("defaultErrnoRet"))
