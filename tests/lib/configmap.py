"""The profile installer's surroundings: the kubelet's ConfigMap volume (with its
atomic ``..data`` swap), this version's profiles as the ConfigMap carries them, the real
apparmor_parser when installed, the installer with each of its passes to wait on, and a
command's stderr read line by line with a deadline."""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin import profiles
from fuse_plugin.profiles.install import Installer, NodePaths, Report

REAL_PARSER = shutil.which("apparmor_parser") or (
    "/usr/sbin/apparmor_parser" if Path("/usr/sbin/apparmor_parser").exists() else None)
needs_parser = pytest.mark.skipif(
    REAL_PARSER is None, reason="apparmor_parser not installed (Debian package 'apparmor'): "
                                "the installer's parse check cannot run")
DEADLINE = 20.0


class ConfigMapVolume:
    """The kubelet's layout for a ConfigMap volume, and its atomic update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.version = 0

    def publish(self, contents: dict[str, bytes]) -> None:
        self.version += 1
        stamp = f"..2026_01_01_00_00_{self.version:02d}.{os.getpid()}"
        new = self.root / stamp
        new.mkdir()
        for name, data in contents.items():
            (new / name).write_bytes(data)
        data_link = self.root / "..data"
        old = os.readlink(data_link) if data_link.is_symlink() else None
        tmp = self.root / "..data_tmp"
        os.symlink(stamp, tmp)
        os.rename(tmp, data_link)  # the swap
        for name in contents:
            link = self.root / name
            if not link.is_symlink():
                os.symlink(f"..data/{name}", link)
        for link in self.root.iterdir():
            if not link.name.startswith(".") and link.name not in contents:
                link.unlink()
        if old:
            shutil.rmtree(self.root / old)


class WatchedInstaller(Installer):
    """The real installer, each of whose passes (``sync``) is an event a test can wait on:
    ``wait_until``."""

    def __init__(self, paths: NodePaths, log: logging.Logger, **options: Any) -> None:
        super().__init__(paths, log, **options)
        self._passed = threading.Condition()
        self._passes = 0
        self._last = Report()

    def sync(self) -> Report:
        report = super().sync()
        with self._passed:
            self._passes += 1
            self._last = report
            self._passed.notify_all()
        return report

    def wait_until(self, condition: Callable[[Report], bool]) -> Report:
        """Wait pass by pass until a pass's report meets ``condition``, with a deadline."""
        deadline = time.monotonic() + DEADLINE
        seen = 0

        def passed() -> bool:
            return self._passes > seen

        with self._passed:
            while True:
                moved = self._passed.wait_for(passed, max(0.0, deadline - time.monotonic()))
                assert moved, "no installer pass met the condition before the deadline"
                seen = self._passes
                if condition(self._last):
                    return self._last


def all_profiles(**overrides: str) -> dict[str, bytes]:
    contents = {}
    for preset in profiles.PRESETS:
        contents[profiles.apparmor_name(preset)] = profiles.render_apparmor(preset).encode()
        contents[profiles.seccomp_file(preset)] = profiles.render_seccomp(preset).encode()
    contents.update({name: text.encode() for name, text in overrides.items()})
    return contents


class Lines:
    """The command's stderr, line by line, readable with a deadline."""

    def __init__(self, stream: object) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.put(line)

    def wait_for(self, *words: str) -> str:
        deadline = time.monotonic() + DEADLINE
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {words} in:\n{''.join(self.seen)}") from None
            self.seen.append(line)
            if all(word in line for word in words):
                return line
