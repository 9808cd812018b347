"""Stopping a long-running command on SIGTERM, SIGINT or SIGHUP, safely.

A Python signal handler runs on the main thread between two bytecodes, possibly while
that thread holds the very lock the handler would need (an Event's condition, the log
handler's lock): calling ``Event.set()`` or logging from the handler can deadlock the
process on SIGTERM. The handler here only starts a thread, which logs and stops.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from fuse_plugin import logs

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signals(log: logging.Logger, stop: Callable[[], None]) -> None:
    """SIGHUP too: a closed terminal or a supervisor's reload must not kill the process
    without its cleanup (our socket, the CDI spec)."""

    def stopping(signum: int) -> None:
        logs.event(log, "signal", signal=signal.Signals(signum).name)
        stop()

    def on_signal(signum: int, _frame: object) -> None:
        threading.Thread(target=stopping, args=(signum,), name="signal").start()

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
