"""inotify watches on directories that may be deleted and made anew.

A directory that is deleted takes its inotify watch with it, and nothing reports that:
the kubelet's device-plugin directory (wiped on some restarts), a broker directory made
after the plugin started, a ConfigMap volume remounted under the profile installer. So
each watch remembers the directory's identity (device and inode) it was put on, and
``rearm`` puts it back on a directory whose identity changed; the owner calls it when an
event on the parent or its periodic re-check says something moved.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path

from watchdog.events import FileSystemEventHandler
from watchdog.observers.api import BaseObserver, ObservedWatch

from fuse_plugin import files, logs


class DirectoryWatches:
    """One non-recursive watch per directory, all sending events to one handler."""

    def __init__(self, observer: BaseObserver, handler: FileSystemEventHandler,
                 log: logging.Logger) -> None:
        self._observer = observer
        self._handler = handler
        self._log = log
        self._watches: dict[Path, tuple[ObservedWatch, files.Identity]] = {}

    def rearm(self, paths: Iterable[Path]) -> None:
        """(Re)arm a watch on each of ``paths`` whose identity changed since it was
        armed; a directory that is missing now is tried again at the next call.

        A directory that cannot be watched (out of inotify watches) is one warning, not
        an error: its owner's periodic re-check still sees what changes there.
        """
        for path in paths:
            identity = files.identity(path, directory=True)
            watched = self._watches.get(path)
            if watched is not None and watched[1] == identity:
                continue
            if watched is not None:
                with contextlib.suppress(KeyError, ValueError):  # its emitter already went
                    self._observer.unschedule(watched[0])
                del self._watches[path]
            if identity is None:
                continue
            try:
                watch = self._observer.schedule(self._handler, str(path), recursive=False)
            except OSError as err:
                logs.event(self._log, "watch.failed", logging.WARNING, path=str(path),
                           error=err.strerror or str(err))
                continue
            self._watches[path] = (watch, identity)
            if watched is not None:
                logs.event(self._log, "watch.rearmed", path=str(path))
