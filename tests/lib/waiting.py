"""Waiting with a deadline, the three ways the tests wait: polling real state
(``wait_for``), waking on file-system events via inotify (``wait_until``), and waking
each time an in-process loop says it has moved on (``wait_notified``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

T = TypeVar("T")


class Timeout(AssertionError):
    """Real state did not reach what a test waited for before its deadline."""


def wait_for(check: Callable[[], T | None], timeout: float, what: str, *, interval: float = 0.05,
             detail: Callable[[], str] | None = None,
             retry_on: tuple[type[Exception], ...] = ()) -> T:
    """Poll ``check()`` until it returns something truthy, and return that; at the
    deadline raise ``Timeout`` naming ``what`` (plus ``detail()``, for the evidence).

    An exception from ``check`` fails the test at once, unless it is one of
    ``retry_on``: what the state raises while it is not there yet (a socket not
    listening, an API not serving); the last one is reported at the deadline.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = check()
        except retry_on as err:
            last = err
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g}s waiting for {what}"
            if last is not None:
                message += f" (last error: {last!r})"
            if detail is not None:
                message += "\n" + detail()
            raise Timeout(message)
        time.sleep(interval)


class _Wake(FileSystemEventHandler):
    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._wake.set()


def wait_until(directory: Path, condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """True once condition() holds; re-checked on every change in ``directory``."""
    wake = threading.Event()
    observer = Observer()
    observer.schedule(_Wake(wake), str(directory))
    observer.start()
    try:
        deadline = threading.Event()

        def expire() -> None:
            deadline.set()
            wake.set()

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            while not condition():
                if deadline.is_set():
                    return condition()
                wake.wait()
                wake.clear()
            return True
        finally:
            timer.cancel()
    finally:
        observer.stop()
        observer.join()


def wait_notified(moved: threading.Condition, condition: Callable[[], bool],
                  timeout: float = 10.0) -> bool:
    """True once condition() holds, re-checked each time ``moved`` is notified (a loop
    that notifies after every turn, as ``Lifecycle.turned``); False at the deadline."""
    with moved:
        return moved.wait_for(condition, timeout)
