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
RULE_KEYS_DOCKER = ("includes", "excludes", "name")
# The OCI LinuxSeccomp struct, its rules and their argument filters. containerd decodes a
# Localhost profile into it and drops any other key silently.
OCI_KEYS = frozenset({"defaultAction", "defaultErrnoRet", "architectures", "flags",
                      "listenerPath", "listenerMetadata", "syscalls"})
RULE_KEYS = frozenset({"names", "action", "errnoRet", "args"})
ARG_KEYS = frozenset({"index", "value", "valueTwo", "op"})
MAX_ARG_INDEX = 5  # system calls take at most six arguments
SHOW_MAX = 60
FUSE_FSTYPE = re.compile(r"^fuse(\.|$)")
# mount(2) operations on an existing mount whose other flags the kernel drops before
# AppArmor sees them: binds, moves and propagation changes.
MOUNT_COMMANDS = frozenset({
    "bind", "B", "rbind", "R", "move", "M",
    *(f"{prefix}{kind}" for prefix in ("", "r", "make-", "make-r")
      for kind in ("private", "shared", "slave", "unbindable")),
})

# Real rules are short; the regular expressions below would take minutes over a
# hostile megabyte-long line (their cost grows with the square of its length).
MAX_RULE = 1000

_BEFORE_COMMENT = frozenset(" \t,{}()")


def rule_lines(text: str) -> list[tuple[int, str]]:
    """(line number, rule) for each rule, comments stripped; a line holding several rules
    (``file, mount,``) gives one entry for each, with its comma."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        # "#include" is a directive, not a comment.
        if stripped.startswith("#include"):
            found.append((number, stripped))
            continue
        found += [(number, rule) for rule in split_rules(uncommented(stripped))]
    return found


def split_rules(line: str) -> list[str]:
    """The rules on one line, each with its comma: split after commas outside (), {}
    and quotes (``options=(rw,nosuid)`` and ``{,/**}`` are one rule's)."""
    rules, depth, quoted, start = [], 0, False, 0
    for index, char in enumerate(line):
        if char == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif char in "({":
            depth += 1
        elif char in ")}":
            depth -= 1
        elif char == "," and depth <= 0:
            rules.append(line[start:index + 1].strip())
            start = index + 1
    rules.append(line[start:].strip())
    return [rule for rule in rules if rule]


def uncommented(line: str) -> str:
    """``line`` without its comment, where apparmor_parser sees one.

    A '#' starts a comment at the start of a line or after a space, ',', a brace or a
    parenthesis; inside a word (``/tmp/a#``, ``peer=a#b``) or quotes it is a character
    like any other, and the rest of the line is policy (seen with apparmor_parser -d).
    """
    quoted = False
    for index, char in enumerate(line):
        if char == '"':
            quoted = not quoted
        elif char == "#" and not quoted and (index == 0 or line[index - 1] in _BEFORE_COMMENT):
            return line[:index]
    return line


def _checkable_rules(text: str) -> tuple[list[str], list[tuple[int, str]]]:
    """Errors for overlong rules, and the other rules (the ones worth checking further)."""
    errors, rules = [], []
    for number, rule in rule_lines(text):
        if len(rule) > MAX_RULE:
            errors.append(f"line {number} is longer than {MAX_RULE} characters")
        else:
            rules.append((number, rule))
    return errors, rules


def _words(rule: str) -> list[str]:
    return [word for word in re.split(r"[\s,]+", rule) if word]


def _fstype(rule: str) -> str | None:
    match = re.search(r"\bfstype\s*=\s*\(?\s*([^\s,)]+)", rule)
    return match.group(1) if match else None


def apparmor(text: str) -> list[str]:
    """Errors in an AppArmor profile meant for FUSE workloads (empty list: clean)."""
    errors, rules = _checkable_rules(text)
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
        for char in uncommented(line):
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
    except RecursionError:
        return ["not JSON we can read: nested too deeply"]
    except ValueError as err:  # a number of more than 4300 digits
        return [f"not JSON we can read: {str(err).split(':', 1)[0]}"]
    return seccomp_profile(profile)


def seccomp_profile(profile: Any) -> list[str]:
    """Errors in a seccomp profile in OCI ``LinuxSeccomp`` form (empty list: clean).

    Any JSON value is fine as input: wrong types are findings, never exceptions.
    """
    errors = seccomp_shape(profile)
    if not isinstance(profile, dict):
        return errors
    errors += _top_level_errors(profile)
    entries = profile.get("syscalls")
    if entries is None:
        errors.append("syscalls must be a list")
    if not isinstance(entries, list):
        return errors
    known = seccomp.known_syscalls()
    seen: Counter[tuple[str, str]] = Counter()
    for index, entry in enumerate(entries):
        where = f"syscalls[{index}]"
        if not isinstance(entry, dict) or _rule_shape(where, entry):
            continue  # reported by seccomp_shape
        errors += _ignored_keys(where, entry) + _rule_errors(where, entry, known)
        args = json.dumps(entry.get("args") or [], sort_keys=True)
        names: list[str] = entry["names"]
        for name, count in Counter(names).items():
            if count > 1:
                errors.append(f"{where}: {_show(name)} listed {count} times")
            seen[(name, args)] += 1
    for (name, args), count in sorted(seen.items()):
        if count > 1:
            what = "" if args == "[]" else f" with the same arguments {args}"
            errors.append(f"{_show(name)} has {count} rules{what}: duplicated")
    return errors


def seccomp_shape(profile: Any) -> list[str]:
    """Only the type errors: what makes ``profile`` something the runtime cannot decode
    into an OCI seccomp profile (a string where a list belongs, say)."""
    if not isinstance(profile, dict):
        return [f"the profile must be a JSON object, not {_kind(profile)}"]
    errors = []
    if not isinstance(profile.get("defaultAction"), str):
        errors.append(f"defaultAction must be a string, not {_show(profile.get('defaultAction'))}")
    arches = profile.get("architectures", [])
    if not isinstance(arches, list) or not all(isinstance(arch, str) for arch in arches):
        errors.append("architectures must be a list of strings")
    entries = profile.get("syscalls", [])
    if not isinstance(entries, list):
        return [*errors, f"syscalls must be a list, not {_kind(entries)}"]
    for index, entry in enumerate(entries):
        where = f"syscalls[{index}]"
        if not isinstance(entry, dict):
            errors.append(f"{where} is not an object but {_kind(entry)}")
        else:
            errors += _rule_shape(where, entry)
    return errors


def _top_level_errors(profile: dict[str, Any]) -> list[str]:
    """What is wrong with the top level's values (its types are seccomp_shape's)."""
    errors = []
    default = profile.get("defaultAction")
    if isinstance(default, str) and default not in ACTIONS:
        errors.append(f"defaultAction {_show(default)} is not a seccomp action")
    elif default in ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG"):
        errors.append(f"defaultAction {default} allows every system call not listed")
    if "defaultErrnoRet" in profile and not _is_uint(profile["defaultErrnoRet"]):
        errors.append("defaultErrnoRet must be a non-negative integer")
    errors += [f"top-level {key!r} is Docker's format; containerd ignores it"
               for key in DOCKER_ONLY if key in profile]
    errors += [f"unknown top-level key {_show(key)}: not in the OCI seccomp format, so "
               "containerd ignores it" for key in profile
               if key not in OCI_KEYS and key not in DOCKER_ONLY]
    arches = profile.get("architectures")
    if not arches:
        errors.append("architectures must be a non-empty list of strings")
    elif isinstance(arches, list):
        errors += [f"unknown architecture {_show(arch)}" for arch in arches
                   if isinstance(arch, str) and arch not in ARCHITECTURES]
    return errors


def _rule_shape(where: str, entry: dict[str, Any]) -> list[str]:
    """Type errors in one ``syscalls`` entry."""
    errors = []
    names = entry.get("names")
    if not isinstance(names, list) or not names \
            or not all(isinstance(name, str) for name in names):
        errors.append(f"{where}: names must be a non-empty list of strings, not "
                      f"{_show(names)}")
    action = entry.get("action")
    if not isinstance(action, str) or action not in ACTIONS:
        errors.append(f"{where}: action {_show(action)} is not a seccomp action")
    if "errnoRet" in entry and not _is_uint(entry["errnoRet"]):
        errors.append(f"{where}: errnoRet must be a non-negative integer")
    args = entry.get("args")
    if args is None:
        return errors
    if not isinstance(args, list):
        return [*errors, f"{where}: args must be a list of argument filters, not "
                         f"{_kind(args)}"]
    for number, arg in enumerate(args):
        errors += _arg_shape(f"{where}.args[{number}]", arg)
    return errors


def _arg_shape(where: str, arg: Any) -> list[str]:
    if not isinstance(arg, dict):
        return [f"{where} is not an object but {_kind(arg)}"]
    errors = []
    index: Any = arg.get("index")
    if not _is_uint(index) or index > MAX_ARG_INDEX:
        errors.append(f"{where}: index must be an integer from 0 to {MAX_ARG_INDEX}, not "
                      f"{_show(index)}")
    if not isinstance(arg.get("op"), str) or arg["op"] not in OPERATORS:
        errors.append(f"{where}: op {_show(arg.get('op'))} is not a seccomp comparison")
    for key in ("value", "valueTwo"):
        if (key == "value" or key in arg) and not _is_uint(arg.get(key)):
            errors.append(f"{where}: {key} must be a non-negative integer (64 bits), not "
                          f"{_show(arg.get(key))}")
    return errors


def _ignored_keys(where: str, entry: dict[str, Any]) -> list[str]:
    """Keys containerd drops silently: a misspelt ``args`` makes a conditional rule
    unconditional."""
    errors = [f"{where}: unknown key {_show(key)}: containerd ignores it" for key in entry
              if key not in RULE_KEYS and key not in RULE_KEYS_DOCKER]
    for number, arg in enumerate(entry.get("args") or []):
        errors += [f"{where}.args[{number}]: unknown key {_show(key)}: containerd ignores it"
                   for key in arg if key not in ARG_KEYS]
    return errors


def _rule_errors(where: str, entry: dict[str, Any], known: frozenset[str]) -> list[str]:
    """What is wrong with a well-typed entry."""
    errors = []
    for key in ("includes", "excludes"):
        if key in entry:
            errors.append(f"{where}: {key!r} conditions are dropped by containerd; "
                          "the rule would apply unconditionally")
    if "name" in entry:
        errors.append(f"{where}: 'name' is the old single-name form; use 'names'")
    errors += [f"{where}: unknown system call {_show(name)} (runc would skip it silently)"
               for name in entry["names"] if name not in known]
    return errors


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 64


def _kind(value: Any) -> str:
    """What a JSON value is, in words (never its contents: they may be huge or deep)."""
    if value is None:
        return "null"
    for types, word in ((bool, "true/false"), ((int, float), "a number"), (str, "a string"),
                        (list, "a list"), (dict, "an object")):
        if isinstance(value, types):
            return word
    return type(value).__name__


def _show(value: Any) -> str:
    """A JSON value for a one-line message: short scalars as they are, else their kind."""
    if isinstance(value, str):
        return repr(value) if len(value) <= SHOW_MAX else repr(value[:SHOW_MAX]) + "..."
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and len(str(value)) <= SHOW_MAX:
        return str(value)
    return _kind(value)
