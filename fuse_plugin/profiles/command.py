"""Flags and bodies of ``profile`` and ``install-profiles``; cli.py only wires them in.

Bad input (an unknown preset, an unsafe name or glob, a missing directory) is a one-line
error with exit code 2 before anything is written; argparse does that for the flags we
can check on their own.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from fuse_plugin import config, files, logs
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
from fuse_plugin.profiles.install import (
    DEFAULT_APPARMOR_DIR,
    DEFAULT_PARSER,
    Installer,
    NodePaths,
)
from fuse_plugin.profiles.presets import DEFAULT_SECCOMP_DIR
from fuse_plugin.signals import stop_on_signals

EXIT_FINDINGS = 1


def _arg(validator: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse type: a ProfileError becomes argparse's one-line usage error (exit 2)."""
    def check(text: str) -> str:
        try:
            return validator(text)
        except ProfileError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return check


def add_profile_flags(parser: argparse.ArgumentParser) -> None:
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


def profile(args: argparse.Namespace, out: TextIO) -> int:
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


def add_install_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True, type=config.absolute_path, metavar="DIR",
                        help="directory with the profiles, usually the mounted ConfigMap: "
                             "AppArmor files named after their profile, seccomp files *.json")
    parser.add_argument("--apparmor-dir", type=config.absolute_path,
                        default=DEFAULT_APPARMOR_DIR, metavar="DIR",
                        help=f"where AppArmor profiles go (default: {DEFAULT_APPARMOR_DIR})")
    parser.add_argument("--seccomp-dir", type=config.absolute_path,
                        default=DEFAULT_SECCOMP_DIR, metavar="DIR",
                        help=f"where seccomp profiles go (default: {DEFAULT_SECCOMP_DIR}; "
                             "pods name them fuse-device-plugin/<preset>.json)")
    parser.add_argument("--apparmor-parser", default=DEFAULT_PARSER, metavar="PROGRAM",
                        help=f"the AppArmor parser to run (default: {DEFAULT_PARSER} on PATH)")
    parser.add_argument("--sys-dir", type=config.absolute_path, default=Path("/sys"),
                        metavar="DIR",
                        help="where sysfs is mounted; AppArmor is detected and checked below "
                             "it (default: /sys)")
    parser.add_argument("--once", action="store_true",
                        help="install and exit (exit 1 if a profile was rejected) instead of "
                             "watching DIR; for init containers")
    parser.add_argument(admit.FLAG, action="store_true",
                        help="also install profiles that are not exactly this version's "
                             "preset profiles (still refused: other profiles' names, "
                             "runtime default names, attachments, hats, change_profile, "
                             "bare mount/umount/pivot_root, exec transitions, seccomp "
                             "allowing bpf, kexec, modules and the like; docs/profiles.md)")
    parser.add_argument("--log-format", type=config.choice(logs.FORMATS), default="text",
                        help="log line format: text or json")
    parser.add_argument("--log-level", type=config.choice(logs.LEVELS), default="info",
                        help="debug, info, warning or error")


def install_profiles(args: argparse.Namespace, paths: NodePaths | None = None) -> int:
    log = logs.setup(args.log_format, args.log_level)
    source: Path = args.source
    if not source.is_dir():
        raise Failure(f"--source {source} is not a directory", EXIT_USAGE)
    paths = paths or NodePaths.under_sys(
        args.sys_dir, source=source, apparmor_dir=args.apparmor_dir,
        seccomp_dir=args.seccomp_dir, parser=args.apparmor_parser)
    installer = Installer(paths, log, allow_custom=args.allow_custom_profiles)

    if not args.once:
        stop_on_signals(log, installer.stop)
    return installer.run(once=args.once)
