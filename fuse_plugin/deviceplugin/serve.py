"""``fuse-device-plugin serve``: the device plugin on this node (what the DaemonSet runs).

Follow a run: the flags (``config``) become ``Settings``, ``plugin.assembled`` builds the
plugin, and the lifecycle's loop serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import sys

from fuse_plugin import config, logs
from fuse_plugin.errors import EXIT_USAGE, Failure


def add_flags(parser: argparse.ArgumentParser) -> None:
    config.add_serve_flags(parser)


def lean_process() -> None:
    """Trim what a serve process of its own holds and spends; no behaviour changes.

    Applied only in a fresh process (the console script, ``python -m fuse_plugin``),
    not when a test calls ``run`` in a process that has already loaded grpc.

    - grpc imports asyncio, which imports Python's ssl and with it OpenSSL: RSS and
      start-up that serve never uses (plain gRPC on unix sockets, plain HTTP for the
      probes; gRPC's own TLS is inside its C core; what it saves: bench/README.md).
      ``ssl`` is hidden only while grpc loads (asyncio takes a missing ssl as "no
      TLS"), so a later ``import ssl`` still works.
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


def run(parsed: argparse.Namespace) -> int:
    lean_process()
    from fuse_plugin.deviceplugin import plugin
    from fuse_plugin.signals import stop_on_signals

    settings = config.from_args(parsed)
    log = logs.setup(settings.log_format, settings.log_level,
                     resource=settings.resource_name)
    directory = settings.device_plugin_dir
    if directory.exists() and not directory.is_dir():
        raise Failure(f"--device-plugin-dir {directory} exists and is not a directory",
                      EXIT_USAGE)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise Failure(f"cannot create --device-plugin-dir {directory}: {err.strerror}") \
            from None
    with plugin.assembled(settings, log) as running:
        lifecycle = running.lifecycle

        stop_on_signals(log, lifecycle.stop)
        return lifecycle.run()
