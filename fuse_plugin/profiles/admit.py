"""What ``install-profiles`` may put on a node.

The installer runs on every node with CAP_MAC_ADMIN and without AppArmor confinement, and
it loads whatever its ConfigMap holds. Unbounded, writing that one ConfigMap would be
writing every node's MAC policy: a ``mount,`` rule, a profile named ``docker-default``
or ``cri-containerd.apparmor.d`` that every container then runs under, a profile that
attaches to host programs, a seccomp profile allowing ``kexec_load``. So:

- By default a file is installed only when it is byte for byte what this version's
  generator makes for its file name: ``<preset>.json`` is ``profile seccomp --preset
  <preset>``, ``fuse-device-plugin-<preset>`` is ``profile apparmor --preset <preset>``,
  optionally with the ``--mountpoint`` its header names (the generator validates the glob,
  and a mountpoint only narrows the rules). The ConfigMap the manifests ship is made by
  the same generator (scripts/gen_manifests.py) and ships with the image, so they agree.
- ``--allow-custom-profiles`` lets operators install profiles of their own. Even then the
  shapes below are refused (:func:`refusals`); ``profile lint`` reports them all.

Not refused, though it looks broad: a bare ``capability,`` (the runtime's default
profile has it too: an AppArmor capability rule only masks what the process already
holds, and the pod spec decides that) and ``ptrace`` in seccomp (the runtime default
allows it on every kernel since 4.8; AppArmor's ``ptrace peer=`` rule and the PID
namespace bound it). Refusing either would refuse this project's own profiles.
"""

from __future__ import annotations

import json
import re
from functools import cache

from fuse_plugin import __version__
from fuse_plugin.profiles import apparmor, lint, seccomp
from fuse_plugin.profiles.presets import PRESETS, apparmor_name, seccomp_file
from fuse_plugin.profiles.validate import ProfileError

FLAG = "--allow-custom-profiles"
PREFIX = "fuse-device-plugin-"
# The container runtimes' own default profiles: a profile under one of these names would
# replace the confinement of every container on the node that does not name a profile.
RUNTIME_DEFAULTS = ("docker-default", "cri-containerd.apparmor.d", "crio-default",
                    "containers-default")
# Profile flags that keep a profile enforcing. complain, unconfined, default_allow and
# prompt would not (lint reports the first two for every profile).
SAFE_FLAGS = frozenset({"attach_disconnected", "mediate_deleted", "enforce", "audit",
                        "chroot_relative", "namespace_relative"})
# Mount-family rules that, bare, allow the operation on anything: any filesystem type,
# any mountpoint, unmounting the runtime's masks over /proc, pivoting anywhere.
BARE_RULES = ("mount", "remount", "umount", "unmount", "pivot_root")
# Includes pull in text the ConfigMap does not hold; only the distribution's shared
# snippets (what the runtime defaults include) are allowed.
INCLUDE = re.compile(r"^#?include(\s+if\s+exists)?\s+<(abstractions|tunables)/[\w.-]+>$")
# File permission letters; an exec mode with p, c or u runs the program under another
# profile or unconfined (``ux``), out of this profile's reach.
_PERMISSIONS = re.compile(r"^[rwaxlkmipPcCuU]+$")
_TRANSITION = re.compile(r"[pPcCuU]")
# A block's brace has space after it; a glob alternation's ({a,b}) never does.
_BLOCK = re.compile(r"\{(\s|$)")
_HEADER = re.compile(r"^profile\s+(\S+)(?:\s+flags\s*=\s*\(([^)]*)\))?\s*\{$")
_REGENERATE = re.compile(r"^#   fuse-device-plugin profile apparmor --preset (\S+)"
                         r" --mountpoint (\S+)$", re.MULTILINE)

# Actions that may let a call through: ALLOW and LOG do; TRACE hands it to a ptracer
# (the container may trace its own children) and NOTIFY to a listener, either may allow.
ALLOWING = frozenset({"SCMP_ACT_ALLOW", "SCMP_ACT_LOG", "SCMP_ACT_TRACE", "SCMP_ACT_NOTIFY"})
# System calls no FUSE profile may allow. None is in the runtime default's allow-list for
# every container (the runtime grants most only with a capability our presets never
# add); each reason is what the call would give a container.
_FORBIDDEN = (
    (("bpf",), "loads programs into the kernel"),
    (("init_module", "finit_module", "delete_module", "create_module"),
     "loads or unloads kernel modules"),
    (("kexec_load", "kexec_file_load"), "replaces the running kernel"),
    (("open_by_handle_at",), "opens any host file by its handle: the 'shocker' escape"),
    (("fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr"),
     "the new mount API, which our AppArmor mount rules are not written for"),
    (("reboot",), "reboots the host"),
    (("swapon", "swapoff"), "changes the host's swap"),
    (("settimeofday", "stime", "clock_settime", "clock_settime64"),
     "sets the host's clock"),
    (("acct",), "switches host-wide process accounting"),
    (("syslog",), "reads and clears the host kernel's log"),
    (("iopl", "ioperm"), "raw access to hardware I/O ports"),
    (("perf_event_open",), "kernel performance events: a large attack surface and side "
                           "channel"),
    (("userfaultfd",), "a common tool for exploiting kernel races"),
    (("keyctl", "add_key", "request_key"), "the kernel keyrings, which are not per "
                                           "container"),
)
FORBIDDEN_SYSCALLS: dict[str, str] = {
    name: why for names, why in _FORBIDDEN for name in names}


def generated(file_name: str, text: str) -> str | None:
    """None when ``text`` is what this version generates for ``file_name``, else why not."""
    for preset in PRESETS:
        if file_name == seccomp_file(preset):
            expected: list[str | None] = [_render_seccomp(preset)]
        elif file_name == apparmor_name(preset):
            expected = [_render_apparmor(preset, None), _regenerated(preset, text)]
        else:
            continue
        if text in expected:
            return None
        return f"not what fuse-device-plugin {__version__} generates for preset {preset}"
    return "not a preset profile"


@cache
def _render_seccomp(preset: str) -> str:
    return seccomp.render(preset)


@cache
def _render_apparmor(preset: str, mountpoint: str | None) -> str:
    return apparmor.render(preset, mountpoint=mountpoint)


def _regenerated(preset: str, text: str) -> str | None:
    """The preset's profile for the ``--mountpoint`` the text's header names, if any."""
    match = _REGENERATE.search(text)
    if match is None or match.group(1) != preset:
        return None
    try:
        return _render_apparmor(preset, match.group(2))
    except ProfileError:
        return None


def refusals(file_name: str, text: str) -> list[str]:
    """The clearly dangerous shapes in a profile: refused with or without FLAG."""
    if file_name.endswith(".json"):
        return _seccomp_refusals(text)
    return _apparmor_refusals(text)


def name_refusals(name: str) -> list[str]:
    if name in RUNTIME_DEFAULTS or name.startswith(RUNTIME_DEFAULTS[2:]):
        return [f"profile {name!r} is a container runtime's default profile: every "
                "container on the node without a profile of its own runs under it"]
    if not name.startswith(PREFIX):
        return [f"profile name {name!r} is not {PREFIX}...: the installer only installs "
                "profiles of its own"]
    return []


# -- AppArmor -----------------------------------------------------------------------------

def _apparmor_refusals(text: str) -> list[str]:
    lines = lint.rule_lines(text)
    headers = [(number, line) for number, line in lines if line.endswith("{")]
    if len(headers) != 1:
        return [f"{len(headers)} blocks open in the file (hats, child profiles or other "
                "profiles): one profile per file, nothing nested"]
    opened, header = headers[0]
    errors = _header_refusals(opened, header)
    closed = [number for number, line in lines if line == "}"]
    if closed != [lines[-1][0]]:
        errors.append("the profile must end with a line holding only '}', the file's last")
    for number, line in lines:
        if line.lstrip("#").startswith("include") or line.startswith("include"):
            if not INCLUDE.match(line):
                errors.append(f"line {number}: '{line}' includes a file the ConfigMap does "
                              "not hold; only <abstractions/...> and <tunables/...>")
        elif number < opened and not line.startswith(("@{", "abi ")):
            errors.append(f"line {number}: '{line}' is outside the profile")
        elif opened < number < lines[-1][0]:
            errors += [f"line {number}: {why}" for why in _rule_refusals(line)]
    return errors


def _header_refusals(number: int, header: str) -> list[str]:
    match = _HEADER.match(header)
    if match is None:
        words = header.split()
        if words[0] == "profile" and len(words) > 2 and words[2].startswith(("/", "@{", '"')):
            return [f"line {number}: the profile attaches to {words[2]}: it would confine "
                    "host programs run from that path"]
        return [f"line {number}: '{header}' is not 'profile NAME [flags=(...)] {{'"]
    errors = name_refusals(match.group(1))
    flags = {flag.strip() for flag in re.split(r"[\s,]+", match.group(2) or "") if flag}
    errors += [f"line {number}: flag {flag} is not allowed (only "
               f"{', '.join(sorted(SAFE_FLAGS))})" for flag in sorted(flags - SAFE_FLAGS)]
    return errors


def _rule_refusals(rule: str) -> list[str]:
    rule = rule.removesuffix(",").strip()
    words = rule.split()
    while words and words[0] in ("audit", "allow", "owner", "quiet"):
        words = words[1:]
    if not words or words[0] == "deny":
        return []
    keyword = words[0]
    checks = (
        (keyword.startswith("^") or keyword in ("hat", "profile") or bool(_BLOCK.search(rule)),
         "defines a hat or child profile: one profile per file"),
        (keyword == "change_profile",
         "lets the process switch to another profile (or to unconfined)"),
        (keyword in BARE_RULES and len(words) == 1,
         "allows it everywhere, /proc, /sys and /dev included"),
        (keyword == "mount" and "fstype" not in rule and "options" not in rule,
         "allows mounting any filesystem type: name fstype= or options="),
        (any(_PERMISSIONS.match(word) and "x" in word and _TRANSITION.search(word)
             for word in words),
         "runs programs under another profile or unconfined"),
    )
    return [f"'{rule},' {why}" for hit, why in checks if hit][:1]


# -- seccomp ------------------------------------------------------------------------------

def _seccomp_refusals(text: str) -> list[str]:
    try:
        profile = json.loads(text)
    except (ValueError, RecursionError):
        return []  # lint says what is wrong with it
    if lint.seccomp_shape(profile):
        return []
    errors = []
    default = profile["defaultAction"]
    if default in ("SCMP_ACT_TRACE", "SCMP_ACT_NOTIFY"):
        errors.append(f"defaultAction {default} may let any system call not listed through")
    for index, rule in enumerate(profile.get("syscalls", [])):
        if rule["action"] in ALLOWING:
            errors += [f"syscalls[{index}] allows {name}: {FORBIDDEN_SYSCALLS[name]}"
                       for name in rule["names"] if name in FORBIDDEN_SYSCALLS]
    return errors

