"""Checks on the names and globs a user hands to the generator and the installer.

Both end up inside AppArmor policy text and as file names under ``/etc/apparmor.d``,
so a profile generator must not be an injection vector: a comma ends an AppArmor rule,
a brace opens an alternation, ``#`` starts a comment, whitespace separates tokens, and
``..`` or ``/`` in a file name escapes the directory. Rather than escape any of that, we
accept a small alphabet and say exactly which character was refused.
"""

from __future__ import annotations

import re

MAX_NAME = 128
MAX_GLOB = 255
# Names that already mean something in /etc/apparmor.d or to the kernel: a profile file
# called "tunables" would collide with the directory, "unconfined" is the kernel's own.
RESERVED_NAMES = frozenset({
    "abi", "abstractions", "cache", "disable", "force-complain", "local", "tunables",
    "unconfined",
})
# Mounting over these would let a container fake the files the runtime writes on
# `exec` (/proc/self/attr, /dev/null) or hide its masks; the profiles deny it outright.
PROTECTED_TREES = ("/proc", "/sys", "/dev")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_GLOB = re.compile(r"^/[A-Za-z0-9._/*?+:=~%-]*$")
_QUOTES = "'\"`"
_BRACES = "{}[]()<>"


class ProfileError(ValueError):
    """Bad input for a profile: the message is one line, fit to show the user as is."""


def _common(kind: str, text: str, limit: int) -> None:
    if not text:
        raise ProfileError(f"{kind} is empty")
    if len(text) > limit:
        raise ProfileError(f"{kind} is {len(text)} characters long; at most {limit} allowed")
    for char in text:
        if char.isspace() or not char.isprintable():
            raise ProfileError(f"{kind} {text!r} contains whitespace or a control character")
        if char in _QUOTES:
            raise ProfileError(f"{kind} {text!r} contains a quote ({char})")
        if char in _BRACES:
            raise ProfileError(f"{kind} {text!r} contains a bracket or brace ({char})")
    if ".." in text:
        raise ProfileError(f"{kind} {text!r} contains '..'")


def profile_name(text: str) -> str:
    """An AppArmor profile name that is also a safe file name in the AppArmor directory."""
    _common("profile name", text, MAX_NAME)
    if not _NAME.match(text):
        raise ProfileError(
            f"profile name {text!r} may only hold letters, digits, '.', '_' and '-', "
            "starting with a letter or digit")
    if text.lower() in RESERVED_NAMES:
        raise ProfileError(f"profile name {text!r} is reserved in /etc/apparmor.d")
    return text


def mountpoint_glob(text: str) -> str:
    """An absolute AppArmor path glob for the FUSE mountpoint (``*``, ``**``, ``?`` allowed)."""
    _common("mountpoint glob", text, MAX_GLOB)
    if not text.startswith("/"):
        raise ProfileError(f"mountpoint glob {text!r} must be an absolute path")
    if not _GLOB.match(text):
        bad = next(c for c in text if not re.match(r"[A-Za-z0-9._/*?+:=~%-]", c))
        raise ProfileError(
            f"mountpoint glob {text!r} contains {bad!r}; allowed are letters, digits, "
            "'/', '.', '_', '-', '+', ':', '=', '~', '%' and the wildcards '*' and '?'")
    for tree in PROTECTED_TREES:
        if text == tree or text.startswith(tree + "/"):
            raise ProfileError(
                f"mountpoint glob {text!r} is under {tree}, where the profiles deny all "
                "mounts (a mount there could fake files the runtime trusts)")
    return text
