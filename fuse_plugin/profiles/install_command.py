"""``fuse-device-plugin install-profiles``: the profile installer's command line (the
installer itself is ``install``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fuse_plugin import args as flags
from fuse_plugin import logs
from fuse_plugin.errors import EXIT_USAGE, Failure
from fuse_plugin.profiles import admit
from fuse_plugin.profiles.install import (
    DEFAULT_APPARMOR_DIR,
    DEFAULT_PARSER,
    Installer,
    NodePaths,
)
from fuse_plugin.profiles.presets import DEFAULT_SECCOMP_DIR
from fuse_plugin.signals import stop_on_signals


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True, type=flags.absolute_path, metavar="DIR",
                        help="directory with the profiles, usually the mounted ConfigMap: "
                             "AppArmor files named after their profile, seccomp files *.json")
    parser.add_argument("--apparmor-dir", type=flags.absolute_path,
                        default=DEFAULT_APPARMOR_DIR, metavar="DIR",
                        help=f"where AppArmor profiles go (default: {DEFAULT_APPARMOR_DIR})")
    parser.add_argument("--seccomp-dir", type=flags.absolute_path,
                        default=DEFAULT_SECCOMP_DIR, metavar="DIR",
                        help=f"where seccomp profiles go (default: {DEFAULT_SECCOMP_DIR}; "
                             "pods name them fuse-device-plugin/<preset>.json)")
    parser.add_argument("--apparmor-parser", default=DEFAULT_PARSER, metavar="PROGRAM",
                        help=f"the AppArmor parser to run (default: {DEFAULT_PARSER} on PATH)")
    parser.add_argument("--sys-dir", type=flags.absolute_path, default=Path("/sys"),
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
                             "allowing bpf, kexec, modules and the like; docs/security.md)")
    flags.add_log_flags(parser)


def run(args: argparse.Namespace, paths: NodePaths | None = None) -> int:
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
