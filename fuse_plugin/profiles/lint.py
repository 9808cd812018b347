"""Our own checks on profiles, for what the tools accept silently.

``apparmor_parser`` happily loads a profile whose ``deny mount,`` shadows every FUSE rule
(deny wins), AppArmor 3.0's parser widens ``mount options=(rw,bind)`` into a second rule
allowing any filesystem there, and runc skips a seccomp rule whose syscall name it cannot
resolve, so a typo is an allow rule that never exists. The installer refuses profiles with
lint errors; the generator's own output must always pass (the tests hold it to that).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from fnmatch import fnmatchcase
from typing import Any

from fuse_plugin.profiles import seccomp

ACTIONS = frozenset({
    "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP",
    "SCMP_ACT_ERRNO", "SCMP_ACT_TRACE", "SCMP_ACT_ALLOW", "SCMP_ACT_LOG",
    "SCMP_ACT_NOTIFY",
})
OPERATORS = frozenset({
    "SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_LE", "SCMP_CMP_EQ", "SCMP_CMP_GE",
    "SCMP_CMP_GT", "SCMP_CMP_MASKED_EQ",
})
ARCHITECTURES = frozenset({
    "SCMP_ARCH_X86", "SCMP_ARCH_X86_64", "SCMP_ARCH_X32", "SCMP_ARCH_ARM",
    "SCMP_ARCH_AARCH64", "SCMP_ARCH_MIPS", "SCMP_ARCH_MIPS64", "SCMP_ARCH_MIPS64N32",
    "SCMP_ARCH_MIPSEL", "SCMP_ARCH_MIPSEL64", "SCMP_ARCH_MIPSEL64N32", "SCMP_ARCH_PPC",
    "SCMP_ARCH_PPC64", "SCMP_ARCH_PPC64LE", "SCMP_ARCH_S390", "SCMP_ARCH_S390X",
    "SCMP_ARCH_PARISC", "SCMP_ARCH_PARISC64", "SCMP_ARCH_RISCV64",
})
# Keys of Docker's profile format that containerd drops without a word.
DOCKER_ONLY = ("includes", "excludes", "archMap", "comment", "name")
FUSE_FSTYPE = re.compile(r"^fuse(\.|$)")
# mount(2) operations on an existing mount whose other flags the kernel drops before
# AppArmor sees them: binds, moves and propagation changes.
MOUNT_COMMANDS = frozenset({
    "bind", "B", "rbind", "R", "move", "M",
    *(f"{prefix}{kind}" for prefix in ("", "r", "make-", "make-r")
      for kind in ("private", "shared", "slave", "unbindable")),
})

_RULE_END = re.compile(r",\s*(#.*)?$")


def _rules(text: str) -> list[tuple[int, str]]:
    """(line number, rule) for each rule line, comments stripped."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        # "#include" is a directive, not a comment.
        rule = stripped if stripped.startswith("#include") else stripped.split("#", 1)[0].strip()
        if rule:
            found.append((number, rule))
    return found


def _words(rule: str) -> list[str]:
    return [word for word in re.split(r"[\s,]+", rule) if word]


def _fstype(rule: str) -> str | None:
    match = re.search(r"\bfstype\s*=\s*\(?\s*([^\s,)]+)", rule)
    return match.group(1) if match else None


def apparmor(text: str) -> list[str]:
    """Errors in an AppArmor profile meant for FUSE workloads (empty list: clean)."""
    errors: list[str] = []
    rules = _rules(text)
    profiles = [rule for _, rule in rules if rule.startswith("profile ")]
    if len(profiles) != 1:
        errors.append(f"expected exactly one 'profile NAME {{' block, found {len(profiles)}")
    if _unbalanced(text):
        errors.append("unbalanced braces")
    allowed_fstypes: list[str] = []
    for number, rule in rules:
        words = _words(rule)
        if words[:1] == ["mount"]:
            errors += _widened(number, rule)
            fstype = _fstype(rule)
            if fstype and FUSE_FSTYPE.match(fstype):
                allowed_fstypes.append(fstype)
                options = re.search(r"options\s*=\s*\(([^)]*)\)", rule)
                flags = {f.strip() for f in options.group(1).split(",")} if options else set()
                missing = [flag for flag in ("nosuid", "nodev") if flag not in flags]
                if missing:
                    errors.append(f"line {number}: FUSE mount rule without "
                                  f"{','.join(missing)}: {rule}")
    for number, rule in rules:
        words = _words(rule)
        if words[:2] == ["deny", "mount"] or words[:3] == ["audit", "deny", "mount"]:
            fstype = _fstype(rule)
            narrowed = "->" in rule
            shadows = not narrowed and (fstype is None or any(
                fnmatchcase(allowed, fstype) or fnmatchcase(fstype, allowed)
                for allowed in allowed_fstypes))
            if shadows:
                errors.append(f"line {number}: '{rule}' shadows the FUSE mount rules "
                              "(a deny rule beats every allow rule)")
        if "flags=" in rule and re.search(r"flags\s*=\s*\([^)]*\b(complain|unconfined)\b", rule):
            errors.append(f"line {number}: profile is not in enforce mode: {rule}")
    if not allowed_fstypes:
        errors.append("no mount rule for a FUSE filesystem type (fuse or fuse.*)")
    return errors


def _widened(number: int, rule: str) -> list[str]:
    """A bind/move/propagation allow rule that AppArmor 3.0 also reads as a new mount.

    apparmor_parser 3.0 (Debian 12, Ubuntu 22.04) compiles ``options=(rw,bind)``, or any
    such operation with another flag beside it, into the operation AND a new mount with
    the other flags, of any filesystem type unless the rule names one: ``mount
    options=(rw,bind) / -> /x/`` then also lets the confined process mount a fresh procfs
    on /x (the VM stage saw it). The kernel ignores those other flags for these
    operations, so they can go. A remount is widened the same way, but its flags matter
    and no spelling avoids it, so remount rules are not reported here.
    """
    if _fstype(rule) is not None:
        return []
    options = re.search(r"options\s*(?:=|\sin)\s*\(([^)]*)\)", rule)
    if not options:
        return []
    flags = {f.strip() for f in options.group(1).split(",") if f.strip()}
    if "remount" in flags:
        return []
    commands = flags & MOUNT_COMMANDS
    others = sorted(flags - MOUNT_COMMANDS)
    if not commands or not others:
        return []
    return [f"line {number}: AppArmor 3.0 reads '{rule}' as also allowing a mount of any "
            f"filesystem type with {','.join(others)} there; write "
            f"options=({','.join(sorted(commands))})"]


def _unbalanced(text: str) -> bool:
    depth = 0
    for line in text.splitlines():
        for char in line.split("#", 1)[0]:
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth < 0:
                return True
    return depth != 0


def seccomp_text(text: str) -> list[str]:
    """Errors in a seccomp profile given as JSON text."""
    try:
        profile = json.loads(text)
    except json.JSONDecodeError as err:
        return [f"not JSON: {err.msg} at line {err.lineno} column {err.colno}"]
    return seccomp_profile(profile)


def seccomp_profile(profile: Any) -> list[str]:
    """Errors in a seccomp profile in OCI ``LinuxSeccomp`` form (empty list: clean)."""
    if not isinstance(profile, dict):
        return ["the profile must be a JSON object"]
    errors = _top_level_errors(profile)
    entries = profile.get("syscalls")
    if not isinstance(entries, list):
        return [*errors, "syscalls must be a list"]
    known = seccomp.known_syscalls()
    seen: Counter[tuple[str, str]] = Counter()
    for index, entry in enumerate(entries):
        where = f"syscalls[{index}]"
        if not isinstance(entry, dict):
            errors.append(f"{where} is not an object")
            continue
        errors += _entry_errors(where, entry, known)
        names = entry.get("names")
        if isinstance(names, list):
            args = json.dumps(entry.get("args") or [], sort_keys=True)
            for name, count in Counter(map(str, names)).items():
                if count > 1:
                    errors.append(f"{where}: {name!r} listed {count} times")
                seen[(name, args)] += 1
    for (name, args), count in sorted(seen.items()):
        if count > 1:
            what = "" if args == "[]" else f" with the same arguments {args}"
            errors.append(f"{name!r} has {count} rules{what}: duplicated")
    return errors


def _top_level_errors(profile: dict[str, Any]) -> list[str]:
    errors = []
    default = profile.get("defaultAction")
    if default not in ACTIONS:
        errors.append(f"defaultAction {default!r} is not a seccomp action")
    elif default in ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG"):
        errors.append(f"defaultAction {default} allows every system call not listed")
    errors += [f"top-level {key!r} is Docker's format; containerd ignores it"
               for key in DOCKER_ONLY if key in profile]
    arches = profile.get("architectures")
    if not isinstance(arches, list) or not arches:
        errors.append("architectures must be a non-empty list")
    else:
        errors += [f"unknown architecture {arch!r}" for arch in arches
                   if arch not in ARCHITECTURES]
    return errors


def _entry_errors(where: str, entry: dict[str, Any], known: frozenset[str]) -> list[str]:
    errors = []
    for key in ("includes", "excludes"):
        if key in entry:
            errors.append(f"{where}: {key!r} conditions are dropped by containerd; "
                          "the rule would apply unconditionally")
    if "name" in entry:
        errors.append(f"{where}: 'name' is the old single-name form; use 'names'")
    names = entry.get("names")
    if not isinstance(names, list) or not names:
        errors.append(f"{where}: names must be a non-empty list")
    else:
        errors += [f"{where}: unknown system call {name!r} (runc would skip it silently)"
                   for name in names if name not in known]
    if entry.get("action") not in ACTIONS:
        errors.append(f"{where}: action {entry.get('action')!r} is not a seccomp action")
    for arg in entry.get("args") or []:
        if not isinstance(arg, dict) or arg.get("op") not in OPERATORS \
                or not isinstance(arg.get("index"), int) or not 0 <= arg["index"] <= 5:
            errors.append(f"{where}: bad argument filter {arg!r}")
    return errors
