"""The ``fuse-device-plugin`` command: one table of subcommands, each a module with
``add_flags(parser)`` and ``run(args) -> exit code`` over the library.

Adding a subcommand is one entry in ``COMMANDS`` plus its module. Only the module of the
command being run is imported (the node's long-running processes need not load the
profile and doctor code), and ``--help`` lists every command from the table alone. A
command fails by raising ``Failure``; the exit code and the one-line message are made
here, nowhere else.

Exit codes: 0 done; 1 a runtime failure (said in one line); 2 bad flags or input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from fuse_plugin import __version__
from fuse_plugin.errors import EXIT_USAGE, Failure

# name -> (module, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("fuse_plugin.deviceplugin.serve", "run the device plugin on this node"),
    "demo": ("fuse_plugin.demo",
             "show registration and Allocate on this machine, no cluster needed"),
    "doctor": ("fuse_plugin.doctor",
               "check this node for FUSE pods (exit 1 on a failure), or --explain a FUSE "
               "error message"),
    "profile": ("fuse_plugin.profiles.generate",
                "print or write the AppArmor or seccomp profile of a FUSE preset"),
    "install-profiles": ("fuse_plugin.profiles.install_command",
                         "install the profiles on this node from DIR (a ConfigMap) and "
                         "reload them when it changes"),
    "broker": ("fuse_plugin.broker.command",
               "run the node's FUSE mount broker (broker mode, docs/broker.md)"),
    "lxcfs": ("fuse_plugin.broker.lxcfs_daemon",
              "run the node's lxcfs for LXCFS views through the broker (docs/broker.md)"),
    "dra": ("fuse_plugin.dra.command",
            "run the DRA driver on this node: /dev/fuse through ResourceClaims "
            "(docs/dra.md)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag, then exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str, code: int) -> int:
    """Print a one-line error for the user and return the exit code to use."""
    print(f"fuse-device-plugin: error: {message}", file=sys.stderr)
    return code


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The CLI, with the flags of the command ``argv`` names (none for ``--help``)."""
    parser = _Parser(prog="fuse-device-plugin", description=(
        "Kubernetes device plugin for github.com/fuse: pods get /dev/fuse without "
        "privileged: true, with least-privilege AppArmor and seccomp profiles."))
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    chosen = argv[0] if argv else None
    for name, (module, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        if name == chosen:
            command = importlib.import_module(module)
            command.add_flags(sub)
            sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs in its own format to stderr; ours are the only lines users need.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        code: int = args.run(args)
    except Failure as err:
        return fail(str(err), err.code)
    return code
