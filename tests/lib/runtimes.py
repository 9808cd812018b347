"""Which container runtime the stages stand for, and what a tenant's container gets from
it when the pod asks for nothing: its default capabilities and its RuntimeDefault
seccomp source. One variable chooses: ``FUSE_E2E_RUNTIME`` is ``containerd`` (the
default) or ``crio``. The cluster stage runs on that runtime (tests/cluster/runtime.py);
the hostile tests (tests/containers, runc driven directly) attack with that runtime's
defaults.

CRI-O's defaults, as CRI-O 1.36.3 (tests/stack/versions.env) has them:

- capabilities: ``internal/config/capabilities/capabilities_linux.go``'s ``Default()``:
  CHOWN, DAC_OVERRIDE, FSETID, FOWNER, SETGID, SETUID, SETPCAP, NET_BIND_SERVICE, KILL;
  so, unlike containerd's set, no SYS_CHROOT, MKNOD, NET_RAW, SETFCAP or AUDIT_WRITE.
- seccomp: ``internal/config/seccomp/seccomp.go``'s ``DefaultProfile()``: the profile of
  the go.podman.io/common module its go.mod requires (``pkg/seccomp/seccomp.json``, read
  here from the Go module cache that tests/stack/build.sh fills), with clone, clone3 and
  unshare taken out of the unconditional allow list and allowed only to a CAP_SYS_ADMIN
  container; without it, clone is allowed only with no namespace flag and clone3 answers
  ENOSYS (so libc falls back to clone). ``crio_seccomp_source`` applies that change to
  the module's file; the cluster stage on CRI-O compares the result with the
  ``linux.seccomp`` CRI-O really wrote for a pod (test_cluster.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fuse_plugin.demo.container import DEFAULT_CAPABILITIES as CONTAINERD_CAPABILITIES
from tests.lib import runtime_default

VARIABLE = "FUSE_E2E_RUNTIME"
RUNTIMES = ("containerd", "crio")

CRIO_CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_KILL",
)
CRIO_MODULE = "github.com/cri-o/cri-o"
COMMON_MODULE = "go.podman.io/common"
# The system calls that create namespaces, which CRI-O moves out of the allow-all rule.
NAMESPACE_CALLS = ("clone", "clone3", "unshare")
# clone's namespace flags (linux/sched.h): NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID,
# NEWNET, NEWCGROUP.
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                         0x40000000, 0x02000000)


class RuntimeChoiceError(Exception):
    """FUSE_E2E_RUNTIME names no runtime the stages know."""


def name() -> str:
    """The chosen runtime; anything but the known names is an error, never a silent
    containerd (a run meant for CRI-O must not pass on containerd's defaults)."""
    chosen = os.environ.get(VARIABLE) or "containerd"
    if chosen not in RUNTIMES:
        raise RuntimeChoiceError(
            f"{VARIABLE}={chosen!r}: the stages know the runtimes {', '.join(RUNTIMES)}")
    return chosen


def is_crio() -> bool:
    return name() == "crio"


def default_capabilities() -> tuple[str, ...]:
    """The bounding set a container gets from the chosen runtime when it adds none."""
    return CRIO_CAPABILITIES if is_crio() else CONTAINERD_CAPABILITIES


def _module_dir(module: str, version: str, gomodcache: Path) -> Path:
    d = gomodcache / f"{module}@{version}"
    if not d.is_dir():
        raise FileNotFoundError(
            f"{d} is missing: tests/stack/build.sh with {VARIABLE}=crio downloads it "
            f"(CRI-O's source and its {COMMON_MODULE})")
    return d


def common_version(crio_dir: Path) -> str:
    """The go.podman.io/common version CRI-O's go.mod requires (what its binary links)."""
    for line in (crio_dir / "go.mod").read_text().splitlines():
        parts = line.split()
        if parts[:1] == [COMMON_MODULE]:
            return parts[1]
    raise ValueError(f"{crio_dir / 'go.mod'} requires no {COMMON_MODULE}")


def stack_gomodcache() -> Path:
    cache_root = Path(os.environ.get("FDP_CACHE", "/var/cache/fuse-device-plugin"))
    return cache_root / "go" / "mod"


def crio_version() -> str:
    versions = Path(__file__).resolve().parents[1] / "stack" / "versions.env"
    for line in versions.read_text().splitlines():
        if line.startswith("CRIO="):
            return line.split("=", 1)[1].strip()
    raise ValueError(f"{versions} pins no CRIO")


def crio_seccomp_source(gomodcache: Path | None = None) -> dict[str, Any]:
    """CRI-O's RuntimeDefault in the containers format that runtime_default converts:
    common's seccomp.json with CRI-O's namespace change (see the module doc)."""
    cache_dir = gomodcache or stack_gomodcache()
    crio_dir = _module_dir(CRIO_MODULE, crio_version(), cache_dir)
    common = _module_dir(COMMON_MODULE, common_version(crio_dir), cache_dir)
    source: dict[str, Any] = json.loads((common / "pkg" / "seccomp" / "seccomp.json")
                                        .read_text())
    return with_namespace_rules(source)


def with_namespace_rules(source: dict[str, Any]) -> dict[str, Any]:
    """``source`` as CRI-O changes it: the namespace calls leave the unconditional allow
    list (CRI-O removes them by index from the one rule that holds them, and refuses to
    start if they are elsewhere) and come back for CAP_SYS_ADMIN only; without it,
    clone with no namespace flag is allowed, with one refused (EPERM), and clone3
    answers ENOSYS."""
    out: dict[str, Any] = json.loads(json.dumps(source))
    for rule in out["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args") \
                and not rule.get("includes") and not rule.get("excludes"):
            rule["names"] = [n for n in rule.get("names") or [] if n not in NAMESPACE_CALLS]
    flags = sum(CLONE_NAMESPACE_FLAGS)
    no_admin = {"caps": ["CAP_SYS_ADMIN"]}
    out["syscalls"] += [
        {"names": list(NAMESPACE_CALLS), "action": "SCMP_ACT_ALLOW", "includes": no_admin},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": flags, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errno": "EPERM", "excludes": no_admin,
         "args": [{"index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}
                  for f in CLONE_NAMESPACE_FLAGS]},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errno": "ENOSYS",
         "excludes": no_admin},
    ]
    return out


def seccomp_source() -> dict[str, Any]:
    """The chosen runtime's RuntimeDefault rules, in the containers format."""
    if is_crio():
        return crio_seccomp_source()
    return runtime_default.read_source()
