"""The ``fuse-device-plugin`` command: parse, build, run. Each subcommand is a function
``cmd_<name>(args) -> exit code`` over the library, so tests can call it directly.

Exit codes: 0 done; 1 a runtime failure (said in one line); 2 bad flags or input.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from fuse_plugin import __version__, config, logs

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag, then exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(message: str, code: int = EXIT_FAILURE) -> int:
    """Print a one-line error for the user and return the exit code to use."""
    print(f"fuse-device-plugin: error: {message}", file=sys.stderr)
    return code


def cmd_serve(args: argparse.Namespace) -> int:
    from fuse_plugin.devices import DeviceState
    from fuse_plugin.lifecycle import Lifecycle
    from fuse_plugin.servicer import FusePlugin

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
    state = DeviceState(settings.fuse_device, settings.slots)
    lifecycle = Lifecycle(settings, state, FusePlugin(state, log), log)

    def on_signal(signum: int, _frame: object) -> None:
        logs.event(log, "signal", signal=signal.Signals(signum).name)
        lifecycle.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return lifecycle.run()
    except OSError as err:
        return fail(f"{err.strerror or err} ({getattr(err, 'filename', '') or ''})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fuse-device-plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser("serve", help="run the device plugin on this node")
    config.add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's C core logs in its own format to stderr; ours are the only lines users need.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code
