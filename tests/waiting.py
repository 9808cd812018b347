"""Wait for file-system events with a deadline, via inotify (watchdog), not sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer


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
