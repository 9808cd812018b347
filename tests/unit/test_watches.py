"""The shared directory watch (``fuse_plugin.watches``) over real inotify: a directory
deleted and made anew is watched again, also when the new one has the old one's inode
(ext4 hands it straight back), and only the owner's events reach the owner."""

from __future__ import annotations

import logging
import os
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from watchdog.events import DirDeletedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from fuse_plugin.watches import DirectoryWatches

WAIT = 10.0


class Seen(FileSystemEventHandler):
    def __init__(self) -> None:
        self.events: queue.Queue[FileSystemEvent] = queue.Queue()

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.events.put(event)

    def wait(self, kind: type[FileSystemEvent], path: Path) -> FileSystemEvent:
        """The first event of ``kind`` at ``path``, or fail at the deadline."""
        while True:
            try:
                event = self.events.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"no {kind.__name__} for {path} within {WAIT:g} s")
            if isinstance(event, kind) and os.fsdecode(event.src_path) == str(path):
                return event


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[DirectoryWatches, Seen, Path]]:
    seen = Seen()
    observer = Observer()
    observer.start()
    try:
        watches = DirectoryWatches(observer, seen, logging.getLogger("test"))
        directory = tmp_path / "watched"
        directory.mkdir()
        watches.rearm([directory])
        yield watches, seen, directory
    finally:
        observer.stop()
        observer.join(WAIT)


def test_a_directory_made_anew_with_the_same_inode_is_watched_again(
        watched: tuple[DirectoryWatches, Seen, Path], caplog: pytest.LogCaptureFixture) -> None:
    watches, seen, directory = watched
    inode = directory.stat().st_ino
    shutil.rmtree(directory)
    seen.wait(DirDeletedEvent, directory)  # the owner hears of it too
    directory.mkdir()
    same_inode = directory.stat().st_ino == inode
    with caplog.at_level(logging.INFO):
        watches.rearm([directory])
    assert "watch.rearmed" in caplog.text, f"same inode: {same_inode}"
    (directory / "new").write_text("")
    seen.wait(FileSystemEvent, directory / "new")


def test_an_unchanged_directory_keeps_its_watch(
        watched: tuple[DirectoryWatches, Seen, Path], caplog: pytest.LogCaptureFixture) -> None:
    watches, seen, directory = watched
    with caplog.at_level(logging.INFO):
        watches.rearm([directory])
    assert "watch.rearmed" not in caplog.text
    (directory / "file").write_text("")
    seen.wait(FileSystemEvent, directory / "file")
