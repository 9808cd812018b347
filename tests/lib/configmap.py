"""The profile installer's surroundings: the kubelet's ConfigMap volume (with its
atomic ``..data`` swap), this version's profiles as the ConfigMap carries them, the real
apparmor_parser when installed, and a command's stderr read line by line with a
deadline."""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from pathlib import Path

import pytest

from fuse_plugin import profiles

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
