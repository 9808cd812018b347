"""``fuse-device-plugin profile``: print or write a preset's AppArmor or seccomp profile,
or lint profile files.

Bad input (an unknown preset, an unsafe name or glob, a missing directory) is a one-line
error with exit code 2 before anything is written; argparse does that for the flags we
can check on their own.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from fuse_plugin import files
from fuse_plugin.errors import EXIT_USAGE, Failure
from fuse_plugin.profiles import (
    PRESETS,
    ProfileError,
    admit,
    lint,
    render_apparmor,
    render_seccomp,
    validate,
)

EXIT_FINDINGS = 1


def _arg(validator: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type: a ProfileError becomes argparse's one-line usage error (exit 2)."""
    def check(text: str) -> str:
        try:
            return validator(text)
        except ProfileError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return check


def add_flags(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="{apparmor,seccomp,lint}",
                                  parser_class=type(parser))
    presets_help = "; ".join(f"{name}: {preset.summary}" for name, preset in PRESETS.items())
    for kind, help_text in (("apparmor", "an AppArmor profile (load with apparmor_parser)"),
                            ("seccomp", "a seccomp profile (OCI JSON for the kubelet)")):
        sub = kinds.add_parser(kind, help=help_text)
        sub.add_argument("--preset", required=True, choices=sorted(PRESETS),
                         help=presets_help)
        if kind == "apparmor":
            sub.add_argument("--name", type=_arg(validate.profile_name),
                             help="profile name (default: fuse-device-plugin-<preset>)")
            sub.add_argument("--mountpoint", metavar="GLOB", type=_arg(validate.mountpoint_glob),
                             help="allow FUSE mounts only at this AppArmor path glob, "
                                  "e.g. /mnt/data or /mnt/* (default: anywhere but "
                                  "/proc, /sys, /dev; /var/lib/lxcfs for lxcfs)")
        sub.add_argument("--output", metavar="FILE", type=Path,
                         help="write the profile to FILE atomically instead of printing it")
    check = kinds.add_parser("lint", help="check profile files: AppArmor, or seccomp (*.json)")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout  # looked up now: a test may have replaced it
    if args.kind == "lint":
        return _lint(args.files, out)
    try:
        if args.kind == "apparmor":
            text = render_apparmor(args.preset, args.name, args.mountpoint)
        else:
            text = render_seccomp(args.preset)
    except ProfileError as err:
        raise Failure(str(err), EXIT_USAGE) from None
    if args.output is None:
        out.write(text)
        return 0
    output: Path = args.output
    if not output.parent.is_dir():
        raise Failure(f"--output {output}: directory {output.parent} does not exist",
                      EXIT_USAGE)
    try:
        mode: int | None = os.lstat(output).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise Failure(f"--output {output}: {err.strerror or err}", EXIT_USAGE) from None
    # The rename would replace a device node, FIFO or symlink itself (once, /dev/full).
    if mode is not None and not stat.S_ISREG(mode):
        raise Failure(f"--output {output} is {files.describe(mode)}; only a regular file "
                      "is replaced", EXIT_USAGE)
    try:
        files.write_atomic(output, text.encode())
    except OSError as err:
        raise Failure(f"cannot write --output {output}: {err.strerror or err}") from None
    return 0


def _lint(paths: list[Path], out: TextIO) -> int:
    failed = False
    for path in paths:
        try:
            data = files.read_regular(path)
        except files.NotReadable as err:
            raise Failure(f"cannot read {path}: {err}", EXIT_USAGE) from None
        except OSError as err:
            raise Failure(f"cannot read {path}: {err.strerror or err}", EXIT_USAGE) from None
        try:
            text = data.decode()
        except UnicodeDecodeError as err:
            errors, custom = [f"not UTF-8 text (byte {err.start})"], None
        else:
            errors, custom = _lint_text(path.name, text)
        for error in errors:
            out.write(f"{path}: {error}\n")
        if not errors:
            out.write(f"{path}: ok\n" if custom is None else
                      f"{path}: ok (install-profiles installs it only with {admit.FLAG}: "
                      f"{custom})\n")
        failed = failed or bool(errors)
    return EXIT_FINDINGS if failed else 0


def _lint_text(name: str, text: str) -> tuple[list[str], str | None]:
    """Everything install-profiles would refuse in ``text`` under file name ``name``, and
    (when nothing) why only --allow-custom-profiles installs it, or None: it is this
    version's own."""
    errors = lint.seccomp_text(text) if name.endswith(".json") else lint.apparmor(text)
    return errors + admit.refusals(name, text), admit.generated(name, text)


