"""``install-profiles`` against temp directories: a real ConfigMap volume layout and its
``..data`` swap, atomic writes, idempotence, a bad profile keeping the old one, SIGTERM.

Two kinds of node: this machine's real one (no AppArmor in the kernel: parse with the
real apparmor_parser, copy, no load), and a node whose kernel has AppArmor, stood in for
by a fake sysfs and a parser wrapper that parses with the real apparmor_parser and
"loads" by listing the profile in the fake ``/sys/kernel/security/apparmor/profiles``.
Nothing here sleeps to synchronise: waits are on events or passes, with deadlines.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin import files, logs, profiles
from fuse_plugin.profiles.install import Installer, NodePaths, loaded_profiles
from tests.lib.configmap import (
    DEADLINE,
    REAL_PARSER,
    ConfigMapVolume,
    Lines,
    WatchedInstaller,
    all_profiles,
    needs_parser,
)

S3FS = "fuse-device-plugin-s3fs"
SSHFS = "fuse-device-plugin-sshfs"


# A profile our lint passes but apparmor_parser refuses. Only --allow-custom-profiles lets
# a profile that is not this version's own get as far as the parser (admit.py), so the
# tests of the parser's and the kernel's refusals use it.
BROKEN_SSHFS = profiles.render_apparmor("sshfs").replace("  file,", "  flie,")


class Node:
    def __init__(self, root: Path, kernel_apparmor: bool) -> None:
        self.root = root
        self.configmap = ConfigMapVolume(root / "configmap")
        self.apparmor_dir = root / "etc-apparmor.d"
        self.seccomp_dir = root / "seccomp" / "fuse-device-plugin"
        self.sys = root / "sys"
        self.calls = root / "parser-calls"
        self.calls.touch()
        parser = REAL_PARSER or "apparmor_parser"
        if kernel_apparmor:
            (self.sys / "module/apparmor/parameters").mkdir(parents=True)
            (self.sys / "module/apparmor/parameters/enabled").write_text("Y\n")
            (self.sys / "kernel/security/apparmor").mkdir(parents=True)
            (self.sys / "kernel/security/apparmor/profiles").write_text("")
            parser = str(self._fake_parser())
        self.paths = NodePaths.under_sys(self.sys, source=self.configmap.root,
                                         apparmor_dir=self.apparmor_dir,
                                         seccomp_dir=self.seccomp_dir, parser=parser)

    def _fake_parser(self) -> Path:
        script = self.root / "apparmor_parser"
        script.write_text(textwrap.dedent(f"""\
            #!{sys.executable}
            # -Q -K FILE: the real parser. -r -K FILE: "load" into the fake securityfs.
            import re, subprocess, sys
            from pathlib import Path
            args = sys.argv[1:]
            text = Path(args[-1]).read_text()
            name = re.search(r"^profile (\\S+)", text, re.M).group(1)
            with open({str(self.calls)!r}, "a") as calls:
                calls.write(" ".join(args[:-1]) + " " + name + "\\n")
            if args[0] == "-Q":
                sys.exit(subprocess.run([{REAL_PARSER!r}, *args]).returncode)
            if "REFUSE-LOAD" in text:
                sys.exit("apparmor_parser: Unable to replace profile: Permission denied")
            listing = Path({str(self.sys / "kernel/security/apparmor/profiles")!r})
            lines = [l for l in listing.read_text().splitlines()
                     if not l.startswith(name + " (")]
            listing.write_text("".join(l + "\\n" for l in [*lines, name + " (enforce)"]))
            """))
        script.chmod(0o755)
        return script

    def loads(self) -> list[str]:
        return [line.split()[-1] for line in self.calls.read_text().splitlines()
                if line.startswith("-r")]

    def installed(self, name: str) -> bytes:
        directory = self.seccomp_dir if name.endswith(".json") else self.apparmor_dir
        return (directory / name).read_bytes()

    def leftovers(self) -> list[str]:
        found = []
        for directory in (self.apparmor_dir, self.seccomp_dir):
            if directory.is_dir():
                found += [p.name for p in directory.iterdir() if p.name.startswith(".")]
        return found


@pytest.fixture
def log() -> logging.Logger:
    return logs.setup("text", "debug")


@pytest.fixture(params=[False, True], ids=["no-apparmor-kernel", "apparmor-kernel"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Node:
    return Node(tmp_path, kernel_apparmor=request.param)


@needs_parser
def test_installs_everything_then_nothing_twice(node: Node, log: logging.Logger) -> None:
    contents = all_profiles()
    node.configmap.publish(contents)
    installer = Installer(node.paths, log)
    report = installer.sync()
    assert report.rejected == {}
    assert report.skipped == []
    assert sorted(report.installed) == sorted(contents)
    for name, data in contents.items():
        assert node.installed(name) == data
        directory = node.seccomp_dir if name.endswith(".json") else node.apparmor_dir
        assert (directory / name).stat().st_mode & 0o777 == 0o644
    kernel = node.paths.apparmor_enabled.exists()
    if kernel:
        assert sorted(node.loads()) == sorted(profiles.apparmor_name(p) for p in profiles.PRESETS)
        assert all(mode == "enforce" for mode in loaded_profiles(node.paths).values())
    mtimes = {p: p.stat().st_mtime_ns for d in (node.apparmor_dir, node.seccomp_dir)
              for p in d.iterdir()}
    calls = node.calls.read_text()

    again = Installer(node.paths, log).sync()  # a restarted installer: idempotent
    assert again.installed == []
    assert sorted(again.unchanged) == sorted(contents)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert node.calls.read_text() == calls, "an unchanged pass must not run the parser"
    assert node.leftovers() == []


@needs_parser
def test_bad_profile_keeps_the_previous_one(node: Node, log: logging.Logger) -> None:
    node.configmap.publish(all_profiles())
    installer = Installer(node.paths, log, allow_custom=True)
    assert installer.sync().ok
    before = node.installed(SSHFS)
    loads_before = node.loads()

    node.configmap.publish(all_profiles(**{SSHFS: BROKEN_SSHFS}))
    report = installer.sync()
    assert list(report.rejected) == [SSHFS]
    assert "does not parse" in report.rejected[SSHFS]
    assert node.installed(SSHFS) == before
    assert node.loads() == loads_before, "a profile that does not parse is never loaded"
    assert node.leftovers() == []
    assert Installer(node.paths, log, allow_custom=True).run(once=True) == 1


def test_lint_and_name_errors_are_rejected(tmp_path: Path, log: logging.Logger) -> None:
    node = Node(tmp_path, kernel_apparmor=False)
    denied = profiles.render_apparmor("s3fs").replace("audit deny mount fstype=fuseblk,",
                                                       "deny mount,")
    node.configmap.publish({
        S3FS: denied.encode(),
        "renamed": profiles.render_apparmor("sshfs").encode(),
        "s3fs.json": profiles.render_seccomp("s3fs").replace('"mount"', '"mnt"').encode(),
        "binary.json": b"\xff\xfe",
    })
    report = Installer(node.paths, log).sync()
    assert set(report.rejected) == {S3FS, "renamed", "s3fs.json", "binary.json"}
    assert "shadows the FUSE mount rules" in report.rejected[S3FS]
    assert "declares profile 'fuse-device-plugin-sshfs'" in report.rejected["renamed"]
    assert "unknown system call 'mnt'" in report.rejected["s3fs.json"]
    assert not node.apparmor_dir.exists() or not any(node.apparmor_dir.iterdir())


def test_kernel_refusal_keeps_the_loaded_profile(tmp_path: Path, log: logging.Logger) -> None:
    if REAL_PARSER is None:
        pytest.skip("apparmor_parser not installed (Debian package 'apparmor')")
    node = Node(tmp_path, kernel_apparmor=True)
    node.configmap.publish(all_profiles())
    installer = Installer(node.paths, log, allow_custom=True)
    assert installer.sync().ok
    before = node.installed(S3FS)
    refused = profiles.render_apparmor("s3fs") + "# REFUSE-LOAD\n"
    node.configmap.publish(all_profiles(**{S3FS: refused}))
    report = installer.sync()
    assert "the kernel refused it" in report.rejected[S3FS]
    assert node.installed(S3FS) == before
    assert node.leftovers() == []


def test_missing_parser_on_a_node_without_apparmor_skips(tmp_path: Path,
                                                        log: logging.Logger) -> None:
    node = Node(tmp_path, kernel_apparmor=False)
    node.configmap.publish(all_profiles())
    paths = NodePaths.under_sys(node.sys, source=node.configmap.root,
                                apparmor_dir=node.apparmor_dir, seccomp_dir=node.seccomp_dir,
                                parser=str(tmp_path / "no-such-parser"))
    report = Installer(paths, log).sync()
    assert report.ok
    assert len(report.skipped) == len(profiles.PRESETS)
    assert sorted(p.name for p in node.seccomp_dir.iterdir()) == sorted(
        profiles.seccomp_file(p) for p in profiles.PRESETS)


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "s3fs.json"
    target.write_bytes(b"old profile")
    inode = target.stat().st_ino
    with target.open("rb") as reader:
        files.write_atomic(target, b"new profile")
        # A reader that had the old file open still reads all of it: the new content
        # arrived as a new inode renamed over the name, not written into the old one.
        assert reader.read() == b"old profile"
    assert target.read_bytes() == b"new profile"
    assert target.stat().st_ino != inode

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        files.write_atomic(target, b"half")
    assert target.read_bytes() == b"new profile"
    assert [p.name for p in tmp_path.iterdir()] == ["s3fs.json"]


# -- watching -----------------------------------------------------------------------------

@pytest.fixture
def watching(node: Node, log: logging.Logger) -> Iterator[tuple[Node, WatchedInstaller]]:
    node.configmap.publish(all_profiles())
    installer = WatchedInstaller(node.paths, log, allow_custom=True)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(installer.run()), daemon=True)
    thread.start()
    installer.wait_until(lambda report: report.ok)
    yield node, installer
    installer.stop()
    thread.join(DEADLINE)
    assert not thread.is_alive()
    assert result == [0]


@needs_parser
def test_reloads_on_configmap_swap(watching: tuple[Node, WatchedInstaller]) -> None:
    node, installer = watching
    narrowed = profiles.render_apparmor("sshfs", mountpoint="/mnt/remote")
    node.configmap.publish(all_profiles(**{SSHFS: narrowed}))
    installer.wait_until(lambda _: node.installed(SSHFS) == narrowed.encode())
    if node.paths.apparmor_enabled.exists():
        assert node.loads().count(SSHFS) == 2, "the changed profile was loaded again"
        assert node.loads().count(S3FS) == 1, "unchanged profiles are not reloaded"

    node.configmap.publish(all_profiles(**{SSHFS: BROKEN_SSHFS}))
    report = installer.wait_until(lambda r: SSHFS in r.rejected)
    assert "does not parse" in report.rejected[SSHFS]
    assert node.installed(SSHFS) == narrowed.encode()
    assert node.leftovers() == []


# -- the real command ---------------------------------------------------------------------

@needs_parser
def test_command_watches_reloads_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    node = Node(tmp_path, kernel_apparmor=False)
    node.configmap.publish(all_profiles())
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuse_plugin", "install-profiles",
         "--source", str(node.configmap.root), "--apparmor-dir", str(node.apparmor_dir),
         "--seccomp-dir", str(node.seccomp_dir), "--sys-dir", str(node.sys),
         "--apparmor-parser", str(REAL_PARSER)],
        stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc.stderr)
        lines.wait_for("apparmor_unavailable", "not loaded")
        lines.wait_for("profiles_synced", f"installed={2 * len(profiles.PRESETS)}")
        lines.wait_for("watching")
        narrowed = profiles.render_apparmor("s3fs", mountpoint="/mnt/s3")
        node.configmap.publish(all_profiles(**{S3FS: narrowed}))
        lines.wait_for("profile_installed", f"profile={S3FS}")
        assert node.installed(S3FS) == narrowed.encode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0
        lines.wait_for("signal", "SIGTERM")
        assert sum("apparmor_unavailable" in line for line in lines.seen) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_parser
def test_command_once_exit_codes(tmp_path: Path) -> None:
    node = Node(tmp_path, kernel_apparmor=False)
    node.configmap.publish(all_profiles())
    argv = [sys.executable, "-m", "fuse_plugin", "install-profiles", "--once",
            "--source", str(node.configmap.root), "--apparmor-dir", str(node.apparmor_dir),
            "--seccomp-dir", str(node.seccomp_dir), "--sys-dir", str(node.sys),
            "--apparmor-parser", str(REAL_PARSER), "--log-format", "json"]
    assert subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0
    node.configmap.publish(all_profiles(**{SSHFS: BROKEN_SSHFS}))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert '"event":"profile_rejected"' in done.stderr
    assert SSHFS in done.stderr


@needs_parser
def test_a_recreated_source_is_found_and_watched_again(tmp_path: Path,
                                                       log: logging.Logger) -> None:
    """inotify's watch dies with the directory: the periodic re-check finds the new one,
    installs what it holds and puts the watch back on it."""
    node = Node(tmp_path, kernel_apparmor=False)
    node.configmap.publish(all_profiles())
    installer = WatchedInstaller(node.paths, log, recheck=0.05)
    thread = threading.Thread(target=installer.run, daemon=True)
    thread.start()
    try:
        installer.wait_until(lambda report: report.ok)
        shutil.rmtree(node.configmap.root)
        installer.wait_until(lambda report: str(node.configmap.root) in report.rejected)
        node.configmap = ConfigMapVolume(node.configmap.root)
        narrowed = profiles.render_apparmor("s3fs", mountpoint="/mnt/s3")
        node.configmap.publish(all_profiles(**{S3FS: narrowed}))
        installer.wait_until(lambda _: node.installed(S3FS) == narrowed.encode())

        # From the next wait on, only the watch can see a change in time.
        installer.recheck = 3600.0
        narrower = profiles.render_apparmor("s3fs", mountpoint="/mnt/s3/a")
        node.configmap.publish(all_profiles(**{S3FS: narrower}))
        installer.wait_until(lambda _: node.installed(S3FS) == narrower.encode())
        narrowest = profiles.render_apparmor("s3fs", mountpoint="/mnt/s3/b")
        node.configmap.publish(all_profiles(**{S3FS: narrowest}))
        installer.wait_until(lambda _: node.installed(S3FS) == narrowest.encode())
    finally:
        installer.stop()
        thread.join(DEADLINE)
    assert not thread.is_alive()
