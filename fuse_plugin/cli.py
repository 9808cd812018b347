"""The ``fuse-device-plugin`` command: parse, build, run. Each subcommand is a function
``cmd_<name>(args) -> exit code`` over the library, so tests can call it directly.

Exit codes: 0 done; 1 a runtime failure (said in one line); 2 bad flags or input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from fuse_plugin import __version__, config, logs
from fuse_plugin.errors import EXIT_FAILURE, EXIT_USAGE, Failure


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag, then exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str, code: int = EXIT_FAILURE) -> int:
    """Print a one-line error for the user and return the exit code to use."""
    print(f"fuse-device-plugin: error: {message}", file=sys.stderr)
    return code


def _lean_process() -> None:
    """Trim what a serve process of its own holds and spends; no behaviour changes.

    Applied only in a fresh process (the console script, ``python -m fuse_plugin``),
    not when a test calls ``cmd_serve`` in a process that has already loaded grpc.

    - grpc imports asyncio, which imports Python's ssl and with it OpenSSL: ~4 MiB of
      RSS and ~9 ms of start-up that serve never uses (plain gRPC on unix sockets, plain
      HTTP for the probes; gRPC's own TLS is inside its C core). ``ssl`` is hidden only
      while grpc loads (asyncio takes a missing ssl as "no TLS"), so a later
      ``import ssl`` still works.
    - glibc gives each thread that mallocs its own arena (up to 8 per CPU), and the gRPC
      worker threads keep freed memory in many half-empty arenas. Two arenas are plenty
      for threads that mostly wait on the GIL.
    - logging looks up the caller's file and line for every record; no formatter of ours
      prints them. This is the switch the logging HOWTO's "Optimization" section documents.
    """
    if {"ssl", "asyncio", "grpc"} & sys.modules.keys():
        return
    logging._srcfile = None
    sys.modules["ssl"] = None  # type: ignore[assignment]  # makes `import ssl` fail
    try:
        import grpc  # noqa: F401
    except ImportError:  # a version that needs ssl after all: imported normally later
        pass
    finally:
        del sys.modules["ssl"]
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX = 2
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def cmd_serve(args: argparse.Namespace) -> int:
    _lean_process()
    from fuse_plugin import plugin
    from fuse_plugin.signals import stop_on_signals

    settings = config.from_args(args)
    log = logs.setup(settings.log_format, settings.log_level,
                     resource=settings.resource_name)
    directory = settings.device_plugin_dir
    if directory.exists() and not directory.is_dir():
        return fail(f"--device-plugin-dir {directory} exists and is not a directory",
                    EXIT_USAGE)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return fail(f"cannot create --device-plugin-dir {directory}: {err.strerror}")
    with plugin.assembled(settings, log) as running:
        lifecycle = running.lifecycle

        stop_on_signals(log, lifecycle.stop)
        return lifecycle.run()


def cmd_broker(args: argparse.Namespace) -> int:
    from fuse_plugin.broker import server

    return server.command(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from fuse_plugin.sim import demo

    return demo.run(sys.stdout, slots=args.slots, mount=args.mount)


def cmd_doctor(args: argparse.Namespace) -> int:
    from fuse_plugin import doctor

    return doctor.command(args, sys.stdout)


def cmd_profile(args: argparse.Namespace) -> int:
    from fuse_plugin.profiles import command

    return command.profile(args, sys.stdout)


def cmd_install_profiles(args: argparse.Namespace) -> int:
    from fuse_plugin.profiles import command

    return command.install_profiles(args)


def build_parser(all_flags: bool = True, broker_flags: bool = False) -> argparse.ArgumentParser:
    """The whole CLI. ``all_flags=False`` leaves out the flags of doctor, profile,
    install-profiles and broker (and the imports behind them): enough to parse a serve
    command; ``broker_flags`` adds the broker's back."""
    parser = _Parser(prog="fuse-device-plugin", description=(
        "Kubernetes device plugin for github.com/fuse: pods get /dev/fuse without "
        "privileged: true, with least-privilege AppArmor and seccomp profiles."))
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser("serve", help="run the device plugin on this node")
    config.add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)

    demo = commands.add_parser(
        "demo", help="show registration and Allocate on this machine, no cluster needed")
    demo.add_argument("--slots", type=config.slots, default=8,
                      help="slots the demo plugin advertises (default: 8)")
    demo.add_argument("--mount", action="store_true",
                      help="also mount a FUSE filesystem in a real unprivileged runc "
                           "container (root, runc, /dev/fuse, squashfuse)")
    demo.set_defaults(func=cmd_demo)

    doctor = commands.add_parser(
        "doctor", help="check this node for FUSE pods (exit 1 on a failure), or "
                       "--explain a FUSE error message")
    doctor.set_defaults(func=cmd_doctor)
    profile = commands.add_parser(
        "profile", help="print or write the AppArmor or seccomp profile of a FUSE preset")
    profile.set_defaults(func=cmd_profile)
    install = commands.add_parser(
        "install-profiles", help="install the profiles on this node from DIR (a ConfigMap) "
                                 "and reload them when it changes")
    install.set_defaults(func=cmd_install_profiles)
    broker = commands.add_parser(
        "broker", help="run the node's FUSE mount broker (broker mode, docs/broker.md)")
    broker.set_defaults(func=cmd_broker)
    if all_flags or broker_flags:
        from fuse_plugin.broker import server as broker_server

        broker_server.add_flags(broker)
    if all_flags:
        from fuse_plugin import doctor as doctor_flags
        from fuse_plugin.profiles import command as profile_flags

        doctor_flags.add_flags(doctor)
        profile_flags.add_profile_flags(profile)
        profile_flags.add_install_flags(install)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs in its own format to stderr; ours are the only lines users need.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = sys.argv[1:] if argv is None else list(argv)
    # serve and broker parse only their own flags: the node's long-running processes need
    # not import the profile and doctor modules (~15 ms of start-up, and watchdog).
    args = build_parser(all_flags=argv[:1] not in (["serve"], ["broker"]),
                        broker_flags=argv[:1] == ["broker"]).parse_args(argv)
    try:
        code: int = args.func(args)
    except Failure as err:
        return fail(str(err), err.code)
    return code
