"""inotify watches on directories that may be deleted and made anew.

A directory that is deleted takes its inotify watch with it, and nothing reports that:
the kubelet's device-plugin directory (wiped on some restarts), a broker directory made
after the plugin started, a ConfigMap volume remounted under the profile installer. So
each watch remembers the directory's identity (device and inode) it was put on, and
``rearm`` puts it back on a directory whose identity changed, or whose deletion its own
watch reported (ext4 gives a directory made anew at once the inode of the one deleted);
the owner calls it when an event on the parent or its periodic re-check says something
moved. The deletion reaches the owner's handler too, so it may look again at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import DirDeletedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import BaseObserver, ObservedWatch

from fuse_plugin import files, logs


def event_paths(event: FileSystemEvent) -> set[str]:
    """The paths an event names, as text: its source, and a move's destination (watchdog
    gives bytes or str, and a destination only on a move)."""
    dest = getattr(event, "dest_path", "") or ""
    return {os.fsdecode(path) for path in (event.src_path, dest) if path}


class DirectoryWatches:
    """One non-recursive watch per directory, all sending events to one handler."""

    def __init__(self, observer: BaseObserver, handler: FileSystemEventHandler,
                 log: logging.Logger) -> None:
        self._observer = observer
        self._handler = _Deletions(handler, self._gone)
        self._log = log
        self._watches: dict[Path, tuple[ObservedWatch, files.Identity]] = {}
        self._deleted: set[Path] = set()  # watched directories reported deleted
        self._ever: set[Path] = set()  # armed at least once: a new arming is a re-arming

    def _gone(self, path: Path) -> None:
        if path in self._watches:
            self._deleted.add(path)

    def rearm(self, paths: Iterable[Path]) -> None:
        """(Re)arm a watch on each of ``paths`` whose identity changed since it was
        armed; a directory that is missing now is tried again at the next call.

        A directory that cannot be watched (out of inotify watches) is one warning, not
        an error: its owner's periodic re-check still sees what changes there.
        """
        for path in paths:
            identity = files.identity(path, directory=True)
            watched = self._watches.get(path)
            if watched is not None and watched[1] == identity and path not in self._deleted:
                continue
            self._deleted.discard(path)
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
            if path in self._ever:
                logs.event(self._log, "watch.rearmed", path=str(path))
            self._ever.add(path)


class _Deletions(FileSystemEventHandler):
    """The owner's handler, first telling the watches of a watched directory deleted."""

    def __init__(self, handler: FileSystemEventHandler,
                 gone: Callable[[Path], None]) -> None:
        self._handler = handler
        self._gone = gone

    def dispatch(self, event: FileSystemEvent) -> None:
        if isinstance(event, DirDeletedEvent):
            self._gone(Path(os.fsdecode(event.src_path)))
        self._handler.dispatch(event)
