"""The node side: copy profiles from a mounted ConfigMap into place, load the AppArmor ones,
and do it again whenever the ConfigMap changes.

A ConfigMap volume is updated by the kubelet with one atomic symlink swap: the files live
in a hidden ``..<timestamp>/`` directory, ``..data`` points at it, and each visible name
is a symlink ``name -> ..data/name``. A new version is a new timestamp directory and a
rename of a fresh symlink over ``..data``. We read one snapshot (the directory ``..data``
points at) per pass, so a pass never mixes two versions.

Order of a pass, per AppArmor profile: read it (a regular file, at most 1 MiB), lint,
check it may be installed at all (admit.py: by default only this version's own preset
profiles), stage a temp file beside the destination, ``apparmor_parser -Q -K`` on it
(parse without loading), ``apparmor_parser -r`` when the kernel has AppArmor, rename
over the destination, check the kernel lists the profile. Any failure discards the temp
file: the previous file and the previous loaded profile stay, and the other files go on.
Seccomp profiles are read, linted, checked and renamed into place. A pass that changes
nothing writes nothing and runs nothing (idempotent).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from fuse_plugin import files, logs
from fuse_plugin.profiles import admit, apparmor, lint, validate
from fuse_plugin.profiles.presets import DEFAULT_SECCOMP_DIR
from fuse_plugin.watches import DirectoryWatches

DEFAULT_APPARMOR_DIR = Path("/etc/apparmor.d")
DEFAULT_PARSER = "apparmor_parser"
APPARMOR_ENABLED = Path("/sys/module/apparmor/parameters/enabled")
APPARMOR_SECURITYFS = Path("/sys/kernel/security/apparmor")
PARSER_TIMEOUT = 60.0
# After a change event, wait for this much quiet (bounded) so one ConfigMap update, which
# arrives as several events, costs one pass.
SETTLE_QUIET = 0.1
SETTLE_MAX = 2.0
# The safety net under the watch: inotify loses its watch for good when the directory
# itself goes (a remounted volume, a re-created dir). A stat of the source and its files
# this often finds such a change, and the watch is put back.
RECHECK_INTERVAL = 10.0
_IGNORED_EVENTS = frozenset({"opened", "closed_no_write"})

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=PARSER_TIMEOUT,
                          check=False)


@dataclass(frozen=True)
class NodePaths:
    """Every place the installer touches; tests point them all at a temp dir."""

    source: Path
    apparmor_dir: Path = DEFAULT_APPARMOR_DIR
    seccomp_dir: Path = DEFAULT_SECCOMP_DIR
    parser: str = DEFAULT_PARSER
    apparmor_enabled: Path = APPARMOR_ENABLED
    securityfs: Path = APPARMOR_SECURITYFS

    @property
    def loaded_profiles(self) -> Path:
        return self.securityfs / "profiles"

    @classmethod
    def under_sys(cls, sys_dir: Path, source: Path, apparmor_dir: Path, seccomp_dir: Path,
                  parser: str = DEFAULT_PARSER) -> NodePaths:
        """The kernel's paths below ``sys_dir`` (normally /sys), the others as given."""
        return cls(source=source, apparmor_dir=apparmor_dir, seccomp_dir=seccomp_dir,
                   parser=parser,
                   apparmor_enabled=sys_dir / "module/apparmor/parameters/enabled",
                   securityfs=sys_dir / "kernel/security/apparmor")


@dataclass
class Report:
    """What one pass did, by file name."""

    installed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.rejected


class Rejected(Exception):
    """A profile that is not installed; the message is the one-line reason."""


def kernel_apparmor(paths: NodePaths) -> tuple[bool, str]:
    """Whether this kernel enforces AppArmor, and what we looked at to say so."""
    try:
        enabled = paths.apparmor_enabled.read_text().strip()
    except OSError:
        if paths.securityfs.is_dir():
            return True, f"{paths.securityfs} exists"
        return False, f"neither {paths.apparmor_enabled} nor {paths.securityfs} exists"
    if apparmor_enabled(enabled):
        return True, f"{paths.apparmor_enabled} is {enabled}"
    return False, f"{paths.apparmor_enabled} is {enabled!r}"


def apparmor_enabled(parameter: str) -> bool:
    """The kernel's ``apparmor/parameters/enabled`` says yes ("Y"); the doctor reads the
    same parameter through this too."""
    return parameter.strip().upper().startswith("Y")


def parse_loaded(listing: str) -> dict[str, str]:
    """Profile name -> mode, from the kernel's list (``name (enforce)`` per line)."""
    loaded = {}
    for line in listing.splitlines():
        name, _, mode = line.rpartition(" (")
        if name:
            loaded[name] = mode.rstrip(")")
    return loaded


def loaded_profiles(paths: NodePaths) -> dict[str, str]:
    return parse_loaded(paths.loaded_profiles.read_text())


def snapshot_dir(source: Path) -> Path:
    """The directory to read: what ``..data`` points at in a ConfigMap volume, else DIR."""
    data = source / "..data"
    if data.is_symlink() or data.is_dir():
        return data.resolve()
    return source


def _parser_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line.strip() for line in (result.stderr + result.stdout).splitlines()
             if line.strip() and not line.startswith("Cache read/write disabled")]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [f"exit code {result.returncode}"])[0]


class Installer:
    def __init__(self, paths: NodePaths, log: logging.Logger,
                 runner: Runner = run_command, recheck: float = RECHECK_INTERVAL,
                 allow_custom: bool = False) -> None:
        self.paths = paths
        self.recheck = recheck
        self.allow_custom = allow_custom
        self.log = log
        self.runner = runner
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._said: set[str] = set()

    # -- one pass -------------------------------------------------------------------------

    def sync(self) -> Report:
        report = Report()
        has_apparmor, why = kernel_apparmor(self.paths)
        parser = self._parser()
        if not has_apparmor:
            self._say_once("apparmor_unavailable", why=why, effect=(
                "AppArmor profiles are parse-checked and copied but not loaded; on this "
                "node only seccomp and capabilities confine FUSE pods, and seccomp cannot "
                "restrict the filesystem type"))
        if parser is None:
            self._say_once("apparmor_parser_missing", parser=self.paths.parser, effect=(
                "AppArmor profiles cannot be checked and are not installed"))
        try:
            sources = self._read_sources()
        except OSError as err:
            report.rejected[str(self.paths.source)] = f"cannot read: {err.strerror or err}"
            logs.event(self.log, "source_unreadable", logging.ERROR,
                       source=str(self.paths.source), error=err.strerror or str(err))
            return self._finish(report)
        for name, data in sources:
            kind = "seccomp" if name.endswith(".json") else "apparmor"
            try:
                if isinstance(data, Rejected):
                    raise data
                if kind == "seccomp":
                    changed = self._install_seccomp(name, data)
                elif parser is None:
                    if has_apparmor:
                        raise Rejected(f"{self.paths.parser} not found: cannot load AppArmor "
                                       "profiles on this AppArmor node")
                    report.skipped.append(name)
                    continue
                else:
                    changed = self._install_apparmor(name, data, parser, has_apparmor)
            except Exception as err:  # one file's trouble must never stop the others
                reason = str(err) if isinstance(err, Rejected) else _unforeseen(err)
                report.rejected[name] = reason
                logs.event(self.log, "profile_rejected", logging.ERROR, kind=kind, profile=name,
                           reason=reason, kept="previous version (if any)")
                continue
            (report.installed if changed else report.unchanged).append(name)
        return self._finish(report)

    def _finish(self, report: Report) -> Report:
        logs.event(self.log, "profiles_synced", installed=len(report.installed),
                   unchanged=len(report.unchanged), rejected=len(report.rejected),
                   skipped=len(report.skipped))
        return report

    def _say_once(self, event: str, **fields: str) -> None:
        if event not in self._said:
            self._said.add(event)
            logs.event(self.log, event, logging.WARNING, **fields)

    def _parser(self) -> str | None:
        if os.sep in self.paths.parser:
            return self.paths.parser if os.access(self.paths.parser, os.X_OK) else None
        # apparmor_parser lives in /usr/sbin, which a non-root PATH may lack.
        return shutil.which(self.paths.parser) or shutil.which(self.paths.parser,
                                                                 path="/usr/sbin:/sbin")

    def _read_sources(self) -> list[tuple[str, bytes | Rejected]]:
        directory = snapshot_dir(self.paths.source)
        try:
            return _read_dir(directory)
        except FileNotFoundError:
            if directory == self.paths.source:
                raise
            # The kubelet deletes the previous snapshot right after a swap: read the new one.
            return _read_dir(snapshot_dir(self.paths.source))

    def _install_seccomp(self, name: str, data: bytes) -> bool:
        _check_name(name.removesuffix(".json"))
        self._admit(name, _linted(data, lint.seccomp_text))
        dest = self.paths.seccomp_dir / name
        if files.read_or_none(dest) == data:
            return False
        try:
            self.paths.seccomp_dir.mkdir(parents=True, exist_ok=True)
            files.write_atomic(dest, data)
        except OSError as err:
            raise Rejected(f"cannot write {dest}: {err.strerror or err}") from None
        logs.event(self.log, "profile_installed", kind="seccomp", profile=name, path=str(dest))
        return True

    def _install_apparmor(self, name: str, data: bytes, parser: str, has_apparmor: bool
                          ) -> bool:
        _check_name(name)
        text = _linted(data, lint.apparmor)
        declared = apparmor.profile_name_of(text)
        if declared != name:
            raise Rejected(f"the file declares profile {declared!r}; name the file after "
                           "the profile")
        self._admit(name, text)
        dest = self.paths.apparmor_dir / name
        same = files.read_or_none(dest) == data
        if same and (not has_apparmor or self._is_loaded(name)):
            return False
        try:
            self.paths.apparmor_dir.mkdir(parents=True, exist_ok=True)
            temp = files.staged(dest, data)
        except OSError as err:
            raise Rejected(f"cannot write {dest}: {err.strerror or err}") from None
        try:
            checked = self.runner([parser, "-Q", "-K", str(temp)])
            if checked.returncode != 0:
                raise Rejected(f"does not parse: {_parser_error(checked)}")
            if has_apparmor:
                loaded = self.runner([parser, "-r", "-K", str(temp)])
                if loaded.returncode != 0:
                    raise Rejected(f"the kernel refused it: {_parser_error(loaded)}")
                if not self._is_loaded(name):
                    raise Rejected(f"loaded, but {self.paths.loaded_profiles} does not list "
                                   "it in enforce mode")
            files.commit(temp, dest)
        except (Rejected, OSError, subprocess.SubprocessError) as err:
            files.discard(temp)
            if isinstance(err, Rejected):
                raise
            raise Rejected(f"{parser} failed: {err}") from None
        logs.event(self.log, "profile_installed", kind="apparmor", profile=name, path=str(dest),
                   loaded=has_apparmor)
        return True

    def _admit(self, name: str, text: str) -> None:
        """Rejected unless this installer may install ``text`` as ``name`` (admit.py)."""
        refusals = admit.refusals(name, text)
        if refusals:
            raise Rejected(_summary(refusals, "refused"))
        if not self.allow_custom:
            differs = admit.generated(name, text)
            if differs:
                raise Rejected(f"{differs}; only {admit.FLAG} installs it")

    def _is_loaded(self, name: str) -> bool:
        try:
            return loaded_profiles(self.paths).get(name) == "enforce"
        except OSError:
            return False

    # -- watching -------------------------------------------------------------------------

    def run(self, once: bool = False) -> int:
        """One pass (``once``: exit 1 if anything was rejected), or pass and watch until
        :meth:`stop`; watching always ends with 0.

        A change is seen by the watch at once, or by the re-check every ``recheck``
        seconds (which also puts the watch back on a source directory made anew).
        """
        if once:
            return 0 if self.sync().ok else 1
        observer = Observer()
        watches = DirectoryWatches(observer, _Wake(self._changed), self.log)
        watches.rearm([self.paths.source])
        observer.start()
        try:
            # The watch is up before the first pass, so no change can fall in between.
            seen = source_fingerprint(self.paths.source)
            self.sync()
            logs.event(self.log, "watching", source=str(self.paths.source))
            while not self._stop.is_set():
                woken = self._changed.wait(self.recheck)
                if self._stop.is_set():
                    break
                if woken:
                    self._settle()
                elif source_fingerprint(self.paths.source) == seen:
                    continue
                watches.rearm([self.paths.source])
                logs.event(self.log, "source_changed", source=str(self.paths.source),
                           seen_by="watch" if woken else "recheck")
                seen = source_fingerprint(self.paths.source)
                self.sync()
        finally:
            observer.stop()
            observer.join(timeout=5)
        return 0

    def _settle(self) -> None:
        deadline = time.monotonic() + SETTLE_MAX
        while not self._stop.is_set() and time.monotonic() < deadline:
            self._changed.clear()
            if not self._changed.wait(SETTLE_QUIET):
                return

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()


class _Wake(FileSystemEventHandler):
    def __init__(self, changed: threading.Event) -> None:
        self.changed = changed

    def on_any_event(self, event: FileSystemEvent) -> None:
        # Our own reads of the source files show up as open/close events: not changes.
        if event.event_type not in _IGNORED_EVENTS:
            self.changed.set()


def source_fingerprint(source: Path) -> tuple[object, ...] | None:
    """What changes when the source does, from stat() alone (cheap enough to poll): the
    directory's identity, the snapshot ``..data`` points at, and each visible file's
    inode, size and mtime. None while the source cannot be read."""
    try:
        directory = snapshot_dir(source)
        entries = []
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat()
                entries.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                entries.append((entry.name, 0, 0, 0))
    except OSError:
        return None
    return files.identity(source, directory=True), str(directory), tuple(entries)


def _read_dir(directory: Path) -> list[tuple[str, bytes | Rejected]]:
    """Each visible file's bytes, or why it cannot be read (the others are still read).

    FileNotFoundError goes to the caller: in a ConfigMap volume it means the kubelet
    removed this snapshot while we read it.
    """
    found: list[tuple[str, bytes | Rejected]] = []
    for name in sorted(entry.name for entry in os.scandir(directory)):
        if name.startswith("."):
            continue
        try:
            found.append((name, files.read_regular(directory / name)))
        except files.NotReadable as err:
            found.append((name, Rejected(f"cannot read: {err}")))
        except FileNotFoundError:
            raise
        except OSError as err:
            found.append((name, Rejected(f"cannot read: {err.strerror or err}")))
    return found


def _unforeseen(err: Exception) -> str:
    """A one-line reason for an error no check foresaw (a bug, but one file's only)."""
    text = " ".join(str(err).split())
    return f"could not be checked: {type(err).__name__}: {text[:200]}"


def _check_name(name: str) -> None:
    try:
        validate.profile_name(name)
    except validate.ProfileError as err:
        raise Rejected(str(err)) from None


def _linted(data: bytes, check: Callable[[str], list[str]]) -> str:
    """The profile as text, or Rejected: a profile our lint faults is never installed."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise Rejected("not UTF-8 text") from None
    errors = check(text)
    if errors:
        raise Rejected(_summary(errors))
    return text


def _summary(errors: list[str], what: str = "lint") -> str:
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{what}: {errors[0]}{more}"
