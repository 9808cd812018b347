"""Hostile files for ``profile lint``, ``install-profiles`` and ``profile --output``: each
ends in a one-line error naming the file and a non-zero exit, never a traceback, a hang
(pytest-timeout and a subprocess timeout) or a half-written file. The real command runs
in a subprocess, as an operator or the DaemonSet runs it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fuse_plugin import __version__, files, logs, profiles
from fuse_plugin.profiles import admit, lint, seccomp
from fuse_plugin.profiles.install import Installer, NodePaths
from tests.lib import doctor_tree
from tests.lib.configmap import (
    DEADLINE,
    REAL_PARSER,
    ConfigMapVolume,
    Lines,
    all_profiles,
    needs_parser,
)

RUN_TIMEOUT = 60
S3FS = "fuse-device-plugin-s3fs"
SSHFS = "fuse-device-plugin-sshfs"
DEEP = 100_000


def seccomp_with(**changes: object) -> bytes:
    """The s3fs seccomp profile with top-level keys replaced (None: removed)."""
    profile = json.loads(profiles.render_seccomp("s3fs"))
    for key, value in changes.items():
        if value is None:
            profile.pop(key, None)
        else:
            profile[key] = value
    return json.dumps(profile).encode()


def seccomp_rule(rule: object) -> bytes:
    """The s3fs seccomp profile with one more syscalls entry."""
    profile = json.loads(profiles.render_seccomp("s3fs"))
    profile["syscalls"].append(rule)
    return json.dumps(profile).encode()


# Malformed seccomp files: (id, bytes, what the one line must say).
SECCOMP_CORPUS = [
    ("deep-array", b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
    ("deep-object", b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested too deeply"),
    ("deep-in-args", seccomp_rule({"names": ["read"], "action": "SCMP_ACT_ALLOW",
                                   "args": [{"index": 0, "op": "SCMP_CMP_EQ",
                                             "value": [[[[[[[[[[1]]]]]]]]]]}]}),
     "value must be a non-negative integer"),
    ("huge-number", b"1" * 5000, "not JSON"),
    ("not-utf8", b'{"defaultAction": "\xff\xfe"}', "not UTF-8"),
    ("empty", b"", "not JSON"),
    ("top-level-list", b"[]", "must be a JSON object"),
    ("default-action-list", b'{"defaultAction": []}', "defaultAction"),
    ("default-action-object", seccomp_with(defaultAction={"a": 1}), "defaultAction"),
    ("architectures-nested", seccomp_with(architectures=[[]]), "architectures"),
    ("syscalls-object", seccomp_with(syscalls={}), "syscalls must be a list"),
    ("names-object", seccomp_rule({"names": [{}], "action": "SCMP_ACT_ALLOW"}),
     "names must be a non-empty list of strings"),
    ("names-string", seccomp_rule({"names": "mount umount2", "action": "SCMP_ACT_ALLOW"}),
     "names must be a non-empty list of strings"),
    ("action-list", seccomp_rule({"names": ["read"], "action": []}), "action"),
    ("args-int", seccomp_rule({"names": ["read"], "action": "SCMP_ACT_ALLOW", "args": 5}),
     "args must be a list"),
    ("arg-op-list", seccomp_rule({"names": ["read"], "action": "SCMP_ACT_ALLOW",
                                  "args": [{"index": 0, "op": [], "value": 1}]}), "op"),
    ("arg-index-bool", seccomp_rule({"names": ["read"], "action": "SCMP_ACT_ALLOW",
                                     "args": [{"index": True, "op": "SCMP_CMP_EQ",
                                               "value": 1}]}), "index"),
    ("errno-string", seccomp_rule({"names": ["read"], "action": "SCMP_ACT_ERRNO",
                                   "errnoRet": "1"}), "errnoRet"),
    ("arg-typo", seccomp_rule({"names": ["read"], "action": "SCMP_ACT_ALLOW",
                               "arg": [{"index": 0, "op": "SCMP_CMP_EQ", "value": 1}]}),
     "unknown key 'arg'"),
    ("huge-name", seccomp_rule({"names": ["x" * 500_000], "action": "SCMP_ACT_ALLOW"}),
     "unknown system call"),
]

# Malformed AppArmor files: the lint must say what is wrong, in reasonable time.
APPARMOR_CORPUS = [
    ("not-utf8", profiles.render_apparmor("s3fs").encode() + b"# \xff\xfe\n", "not UTF-8"),
    ("empty", b"", "exactly one 'profile NAME {' block"),
    ("deep-braces", b"{" * DEEP + b"}" * DEEP, "longer than"),
    ("long-rule", b"profile fuse-device-plugin-s3fs {\n  mount " + b"options=(" * 100_000
     + b"\n}\n", "longer than"),
]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fuse_plugin", *argv], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, check=False)


def assert_clean_failure(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr


# -- profile lint -------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "data", "said"),
                         [(f"{case}.json", data, said) for case, data, said in SECCOMP_CORPUS]
                         + [(f"{case}-apparmor", data, said)
                            for case, data, said in APPARMOR_CORPUS],
                         ids=[case for case, _, _ in SECCOMP_CORPUS]
                         + [f"apparmor-{case}" for case, _, _ in APPARMOR_CORPUS])
def test_lint_says_what_is_wrong_in_lines_naming_the_file(tmp_path: Path, name: str,
                                                          data: bytes, said: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    done = run("profile", "lint", str(path))
    assert_clean_failure(done)
    lines = (done.stdout + done.stderr).splitlines()
    assert lines
    assert all(str(path) in line and len(line) < 400 for line in lines), lines
    assert any(said in line for line in lines), lines


SPECIAL_FILES = ["fifo", "dev-zero-symlink", "directory", "oversized"]


def make_special(path: Path, kind: str) -> None:
    """A path where a profile is expected that a plain read would hang on, or never end."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero-symlink":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b" " * (files.READ_LIMIT + 1))


@pytest.mark.parametrize("kind", SPECIAL_FILES)
def test_lint_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "s3fs.json"
    make_special(path, kind)
    done = run("profile", "lint", str(path))
    assert_clean_failure(done)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"cannot read {path}: " in done.stderr
    assert ("not a regular file" in done.stderr) != (kind == "oversized")


# -- install-profiles --once --------------------------------------------------------------

def install_once(source: Path, dest: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run("install-profiles", "--once", "--source", str(source),
               "--apparmor-dir", str(dest / "apparmor.d"), "--seccomp-dir",
               str(dest / "seccomp"), "--sys-dir", str(dest / "sys"),
               "--apparmor-parser", str(REAL_PARSER), *extra)


def installed(dest: Path) -> dict[str, bytes]:
    found = {}
    for directory in (dest / "apparmor.d", dest / "seccomp"):
        if directory.is_dir():
            found.update({path.name: path.read_bytes() for path in directory.iterdir()})
    return found


@needs_parser
@pytest.mark.parametrize(("name", "data", "said"),
                         [("s3fs.json", data, said) for _, data, said in SECCOMP_CORPUS]
                         + [(S3FS, data, said) for _, data, said in APPARMOR_CORPUS],
                         ids=[case for case, _, _ in SECCOMP_CORPUS]
                         + [f"apparmor-{case}" for case, _, _ in APPARMOR_CORPUS])
def test_install_once_refuses_the_bad_file_and_installs_the_rest(
        tmp_path: Path, name: str, data: bytes, said: str) -> None:
    source, dest = tmp_path / "source", tmp_path / "node"
    source.mkdir()
    good = all_profiles()
    for file_name, text in good.items():
        (source / file_name).write_bytes(text)
    assert install_once(source, dest).returncode == 0
    before = installed(dest)
    assert before == good

    # The bad file, and beside it a changed good one that must still go in.
    narrowed = profiles.render_apparmor("sshfs", mountpoint="/mnt/remote").encode()
    (source / SSHFS).write_bytes(narrowed)
    (source / name).write_bytes(data)
    done = install_once(source, dest)
    assert_clean_failure(done)
    assert done.returncode == 1
    rejected = [line for line in done.stderr.splitlines() if "profile_rejected" in line]
    assert len(rejected) == 1, done.stderr
    assert name in rejected[0]
    assert said in rejected[0]
    assert len(rejected[0]) < 400
    assert installed(dest) == {**before, SSHFS: narrowed}, "the old profile stays"
    assert not [p for p in os.listdir(dest / "seccomp") if p.startswith(".")]


# -- install-profiles, watching -----------------------------------------------------------

@needs_parser
def test_watching_installer_outlives_every_bad_file(tmp_path: Path) -> None:
    configmap = ConfigMapVolume(tmp_path / "configmap")
    configmap.publish(all_profiles())
    dest = tmp_path / "node"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fuse_plugin", "install-profiles",
         "--source", str(configmap.root), "--apparmor-dir", str(dest / "apparmor.d"),
         "--seccomp-dir", str(dest / "seccomp"), "--sys-dir", str(dest / "sys"),
         "--apparmor-parser", str(REAL_PARSER)],
        stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc.stderr)
        lines.wait_for("profiles_synced", f"installed={2 * len(profiles.PRESETS)}")
        good = installed(dest)
        for name, corpus in (("s3fs.json", SECCOMP_CORPUS), (S3FS, APPARMOR_CORPUS)):
            for case, data, said in corpus:
                configmap.publish({**all_profiles(), name: data,
                                   "generic.json": case.encode()})  # a change each time
                line = lines.wait_for("profile_rejected", f"profile={name}")
                assert said in line, (case, line)
        narrowed = profiles.render_apparmor("sshfs", mountpoint="/mnt/remote").encode()
        configmap.publish(all_profiles(**{SSHFS: narrowed.decode()}))
        lines.wait_for("profile_installed", f"profile={SSHFS}")
        assert installed(dest) == {**good, SSHFS: narrowed}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0
        assert not any("Traceback" in line for line in lines.seen), "".join(lines.seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_check_that_breaks_rejects_only_its_file(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The net under every check: a bug in one (here a lint that raises) costs one file."""
    configmap = ConfigMapVolume(tmp_path / "configmap")
    configmap.publish({name: data for name, data in all_profiles().items()
                       if name.endswith(".json")})
    paths = NodePaths.under_sys(tmp_path / "sys", source=configmap.root,
                                apparmor_dir=tmp_path / "apparmor.d",
                                seccomp_dir=tmp_path / "seccomp")
    real = lint.seccomp_text

    def broken(text: str) -> list[str]:
        if text == profiles.render_seccomp("lxcfs"):
            raise TypeError("unhashable type: 'list'")
        return real(text)

    monkeypatch.setattr(lint, "seccomp_text", broken)
    report = Installer(paths, logs.setup("text", "info")).sync()
    assert report.rejected == {
        "lxcfs.json": "could not be checked: TypeError: unhashable type: 'list'"}
    assert sorted(report.installed) == sorted(
        profiles.seccomp_file(p) for p in profiles.PRESETS if p != "lxcfs")


@needs_parser
def test_install_once_refuses_special_files_beside_good_ones(tmp_path: Path) -> None:
    source, dest = tmp_path / "source", tmp_path / "node"
    source.mkdir()
    good = all_profiles()
    for file_name, text in good.items():
        (source / file_name).write_bytes(text)
    names = [f"special-{kind}.json" for kind in SPECIAL_FILES]
    for name, kind in zip(names, SPECIAL_FILES, strict=True):
        make_special(source / name, kind)
    done = install_once(source, dest)
    assert_clean_failure(done)
    assert done.returncode == 1
    rejected = [line for line in done.stderr.splitlines() if "profile_rejected" in line]
    assert sorted(line.split("profile=")[1].split()[0] for line in rejected) == sorted(names)
    assert installed(dest) == good


# -- profile --output and the atomic writer -----------------------------------------------

OUTPUT_TARGETS = ["char-device", "fifo", "symlink-to-file", "dangling-symlink", "socket"]


def make_target(path: Path, kind: str) -> None:
    if kind == "char-device":
        if os.geteuid() != 0:
            pytest.skip("needs root: mknod")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # what /dev/full is
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink-to-file":
        (path.parent / "elsewhere").write_text("keep me\n")
        path.symlink_to("elsewhere")
    elif kind == "dangling-symlink":
        path.symlink_to("nowhere")
    else:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))


@pytest.mark.parametrize("kind", OUTPUT_TARGETS)
def test_output_refuses_to_replace_anything_but_a_regular_file(tmp_path: Path,
                                                                kind: str) -> None:
    target = tmp_path / "profile.json"
    make_target(target, kind)
    before = os.lstat(target)
    done = run("profile", "seccomp", "--preset", "s3fs", "--output", str(target))
    assert_clean_failure(done)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"--output {target} " in done.stderr
    after = os.lstat(target)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    if kind == "symlink-to-file":
        assert (tmp_path / "elsewhere").read_text() == "keep me\n"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_output_replaces_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "s3fs.json"
    target.write_text("old")
    done = run("profile", "seccomp", "--preset", "s3fs", "--output", str(target))
    assert done.returncode == 0, done.stderr
    assert target.read_text() == profiles.render_seccomp("s3fs")


def test_writer_leaves_nothing_when_the_rename_fails(tmp_path: Path) -> None:
    target = tmp_path / "in-the-way"
    (target / "child").mkdir(parents=True)  # rename(2) cannot replace a non-empty dir
    with pytest.raises(IsADirectoryError):
        files.write_atomic(target, b"data")
    assert sorted(os.listdir(tmp_path)) == ["in-the-way"]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB filesystem: writes beyond that fail with ENOSPC in the kernel."""
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                           str(mountpoint)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_writer_leaves_nothing_on_a_full_filesystem(small_tmpfs: Path) -> None:
    target = small_tmpfs / "s3fs.json"
    files.write_atomic(target, b"old profile")
    with pytest.raises(OSError, match="No space left") as err:
        files.write_atomic(target, b"x" * (1 << 20))
    assert err.value.errno == errno.ENOSPC
    assert os.listdir(small_tmpfs) == ["s3fs.json"]
    assert target.read_bytes() == b"old profile"


def test_output_on_a_full_filesystem_is_one_line_and_leaves_nothing(small_tmpfs: Path
                                                                    ) -> None:
    (small_tmpfs / "filler").write_bytes(b"x" * (60 << 10))
    target = small_tmpfs / "lxcfs.json"
    done = run("profile", "seccomp", "--preset", "lxcfs", "--output", str(target))
    assert_clean_failure(done)
    assert done.stderr.count("\n") == 1, done.stderr
    assert "No space left on device" in done.stderr
    assert os.listdir(small_tmpfs) == ["filler"]


# -- doctor -------------------------------------------------------------------------------

PROC_FILESYSTEMS = "proc/filesystems"
APPARMOR_ENABLED = "sys/module/apparmor/parameters/enabled"
APPARMOR_LIST = "sys/kernel/security/apparmor/profiles"
S3FS_SECCOMP = f"{doctor_tree.SECCOMP_DIR}/s3fs.json"
NAMES_AS_STRING = json.dumps({"defaultAction": "SCMP_ACT_ERRNO",
                              "architectures": ["SCMP_ARCH_X86_64"],
                              "syscalls": [{"names": "mount umount2",
                                            "action": "SCMP_ACT_ALLOW"}]}).encode()

# (id, file under the node root, what to put there, the doctor line, what it must say)
DOCTOR_CORPUS = [
    ("seccomp-fifo", S3FS_SECCOMP, "fifo", "seccomp profiles", "a FIFO, not a regular file"),
    ("seccomp-dev-zero", S3FS_SECCOMP, "dev-zero-symlink", "seccomp profiles",
     "a character device, not a regular file"),
    ("seccomp-dev-zero-bind", S3FS_SECCOMP, "dev-zero-bind", "seccomp profiles",
     "a character device, not a regular file"),
    ("seccomp-oversized", S3FS_SECCOMP, "oversized", "seccomp profiles", "larger than"),
    ("seccomp-not-utf8", S3FS_SECCOMP, b'{"defaultAction": "\xff"}', "seccomp profiles",
     "not UTF-8"),
    ("seccomp-deep", S3FS_SECCOMP, b"[" * DEEP + b"]" * DEEP, "seccomp profiles",
     "nested too deeply"),
    ("seccomp-names-string", S3FS_SECCOMP, NAMES_AS_STRING, "seccomp profiles",
     "names must be a non-empty list of strings"),
    ("filesystems-fifo", PROC_FILESYSTEMS, "fifo", "fuse filesystem", "a FIFO"),
    ("filesystems-dev-zero", PROC_FILESYSTEMS, "dev-zero-symlink", "fuse filesystem",
     "a character device"),
    ("filesystems-not-utf8", PROC_FILESYSTEMS, b"nodev\tfuse\xff\n", "fuse filesystem",
     "not UTF-8"),
    ("apparmor-enabled-fifo", APPARMOR_ENABLED, "fifo", "apparmor", "a FIFO"),
    ("apparmor-enabled-not-utf8", APPARMOR_ENABLED, b"\xffY\n", "apparmor", "not UTF-8"),
    ("apparmor-list-fifo", APPARMOR_LIST, "fifo", "apparmor profiles", "a FIFO"),
    ("apparmor-list-dev-zero", APPARMOR_LIST, "dev-zero-symlink", "apparmor profiles",
     "a character device"),
]


@pytest.fixture
def doctor_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fdp-doctor-", dir="/tmp") as name:
        root = Path(name)
        doctor_tree.build_static_tree(root)
        yield root


@pytest.mark.parametrize(("path", "bad", "line", "said"),
                         [case[1:] for case in DOCTOR_CORPUS],
                         ids=[case[0] for case in DOCTOR_CORPUS])
def test_doctor_gives_one_finding_for_each_bad_file(doctor_root: Path, path: str,
                                                     bad: str | bytes, line: str,
                                                     said: str) -> None:
    target = doctor_root / path
    target.unlink()
    bound = False
    if isinstance(bad, bytes):
        target.write_bytes(bad)
    elif bad == "dev-zero-bind":
        target.touch()
        done = subprocess.run(["mount", "--bind", "/dev/zero", str(target)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot bind-mount (needs root): {done.stderr.strip()}")
        bound = True
    else:
        make_special(target, bad)
    try:
        done = run("doctor", "--root", str(doctor_root), "--output", "json")
    finally:
        if bound:
            subprocess.run(["umount", str(target)], check=True)
    assert_clean_failure(done)
    assert done.returncode == 1
    checks = {check["name"]: check for check in json.loads(done.stdout)["checks"]}
    detail = checks[line]["detail"]
    assert checks[line]["verdict"] in ("warn", "fail"), detail
    assert said in detail
    assert "\n" not in detail
    assert len(detail) < 400


# -- what the installer may install (issue 15) --------------------------------------------

S3FS_TEXT = profiles.render_apparmor("s3fs")


def with_rule(rule: str) -> str:
    return S3FS_TEXT.replace("  file,\n", f"  file,\n{rule}\n")


def renamed(name: str) -> str:
    return S3FS_TEXT.replace(S3FS, name)


def seccomp_allowing(name: str, action: str = "SCMP_ACT_ALLOW") -> str:
    return seccomp_rule({"names": [name], "action": action}).decode()


# Profiles that parse and pass the FUSE lint, yet would hand a ConfigMap writer the
# node: (id, file name, text, the first reason given). Refused with or without
# --allow-custom-profiles.
DANGEROUS = [
    ("bare-mount", S3FS, with_rule("  mount,"), "allows it everywhere"),
    ("bare-umount", S3FS, with_rule("  umount,"), "allows it everywhere"),
    ("bare-pivot-root", S3FS, with_rule("  pivot_root,"), "allows it everywhere"),
    ("mount-any-type", S3FS, with_rule("  mount -> /mnt/**,"), "any filesystem type"),
    ("mount-behind-a-hash", S3FS, with_rule("  /tmp/a# r, mount,"), "allows it everywhere"),
    ("mount-second-on-line", S3FS, with_rule("  signal, mount,"), "allows it everywhere"),
    ("change-profile", S3FS, with_rule("  change_profile -> **,"), "another profile"),
    ("unconfined-exec", S3FS, with_rule("  /usr/bin/** ux,"), "unconfined"),
    ("profile-exec", S3FS, with_rule("  /usr/bin/** Px -> docker-default,"),
     "another profile"),
    ("hat", S3FS, with_rule("  ^hat {\n    mount,\n  }"), "2 blocks open"),
    ("inline-hat", S3FS, with_rule("  ^hat { mount, }"), "hat or child profile"),
    ("child-profile", S3FS, with_rule("  profile child {\n    mount,\n  }"),
     "exactly one 'profile NAME {' block"),
    ("attachment", S3FS, S3FS_TEXT.replace(f"profile {S3FS} flags", f"profile {S3FS} "
                                           "/usr/bin/** flags"), "attaches to /usr/bin/**"),
    ("profile-by-path", S3FS, S3FS_TEXT + "/usr/bin/foo {\n  mount,\n}\n", "2 blocks open"),
    ("extra-profile", S3FS, S3FS_TEXT + "profile fuse-device-plugin-x {\n  mount,\n}\n",
     "exactly one 'profile NAME {' block"),
    ("docker-default", "docker-default", renamed("docker-default"),
     "a container runtime's default profile"),
    ("cri-containerd", "cri-containerd.apparmor.d", renamed("cri-containerd.apparmor.d"),
     "a container runtime's default profile"),
    ("outside-prefix", "team-a", renamed("team-a"), "is not fuse-device-plugin-..."),
    ("default-allow-flag", S3FS, S3FS_TEXT.replace("mediate_deleted)",
                                                   "mediate_deleted,default_allow)"),
     "flag default_allow is not allowed"),
    ("include-elsewhere", S3FS, with_rule('  include "/var/lib/kubelet/pods/x/rules"'),
     "includes a file the ConfigMap does not hold"),
    *[(f"seccomp-{name}", "s3fs.json", seccomp_allowing(name), f"allows {name}:")
      for name in ("bpf", "kexec_load", "kexec_file_load", "init_module", "finit_module",
                   "delete_module", "open_by_handle_at", "perf_event_open", "fsmount",
                   "keyctl")],
    ("seccomp-bpf-logged", "s3fs.json", seccomp_allowing("bpf", "SCMP_ACT_LOG"),
     "allows bpf:"),
    ("seccomp-bpf-notify", "s3fs.json", seccomp_allowing("bpf", "SCMP_ACT_NOTIFY"),
     "allows bpf:"),
    ("seccomp-default-notify", "s3fs.json", seccomp_with(
        defaultAction="SCMP_ACT_NOTIFY").decode(), "defaultAction SCMP_ACT_NOTIFY"),
]
DANGEROUS_IDS = [case[0] for case in DANGEROUS]


def installer_for(tmp_path: Path, contents: dict[str, bytes], custom: bool) -> Installer:
    configmap = ConfigMapVolume(tmp_path / "configmap")
    configmap.publish(contents)
    paths = NodePaths.under_sys(tmp_path / "sys", source=configmap.root,
                                apparmor_dir=tmp_path / "apparmor.d",
                                seccomp_dir=tmp_path / "seccomp",
                                parser=REAL_PARSER or "apparmor_parser")
    return Installer(paths, logs.setup("text", "info"), allow_custom=custom)


@needs_parser
@pytest.mark.parametrize("custom", [False, True], ids=["default", "allow-custom"])
@pytest.mark.parametrize(("name", "text", "said"), [case[1:] for case in DANGEROUS],
                         ids=DANGEROUS_IDS)
def test_dangerous_profiles_are_refused_in_every_mode(tmp_path: Path, name: str, text: str,
                                                      said: str, custom: bool) -> None:
    installer = installer_for(tmp_path, {name: text.encode()}, custom)
    report = installer.sync()
    assert list(report.rejected) == [name]
    assert said in report.rejected[name]
    assert report.installed == []
    assert not any((tmp_path / d).is_dir() and any((tmp_path / d).iterdir())
                   for d in ("apparmor.d", "seccomp"))


@pytest.mark.parametrize(("name", "text", "said"), [case[1:] for case in DANGEROUS],
                         ids=DANGEROUS_IDS)
def test_lint_reports_what_the_installer_refuses(tmp_path: Path, name: str, text: str,
                                                 said: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    done = run("profile", "lint", str(path))
    assert_clean_failure(done)
    assert done.returncode == 1
    assert any(line.startswith(f"{path}: ") and said in line
               for line in done.stdout.splitlines()), done.stdout


def test_forbidden_system_calls_are_none_a_preset_allows() -> None:
    """The list is what no FUSE profile may allow: refusing one of them must never refuse
    the project's own profiles, and each must be a real system call name."""
    allowed = set(seccomp.runtime_default_syscalls()) | {"clone", "clone3", "personality"}
    for preset in profiles.PRESETS.values():
        allowed |= set(preset.syscalls)
    assert not allowed & set(admit.FORBIDDEN_SYSCALLS)
    assert set(admit.FORBIDDEN_SYSCALLS) <= seccomp.known_syscalls()


TEAM = "fuse-device-plugin-team-a"
CUSTOM_SECCOMP = json.dumps({"defaultAction": "SCMP_ACT_ERRNO",
                             "architectures": ["SCMP_ARCH_X86_64"],
                             "syscalls": [{"names": ["read", "write", "exit_group"],
                                           "action": "SCMP_ACT_ALLOW"}]})


def mixed_source() -> dict[str, bytes]:
    """This version's presets (one narrowed to a mountpoint), beside profiles that are not
    exactly what it generates for their names."""
    return {
        **all_profiles(),
        SSHFS: profiles.render_apparmor("sshfs", mountpoint="/mnt/remote").encode(),
        TEAM: profiles.render_apparmor("generic", name=TEAM, mountpoint="/data").encode(),
        "s3fs.json": profiles.render_seccomp("s3fs").encode() + b"\n",
        "custom.json": CUSTOM_SECCOMP.encode(),
        "fuse-device-plugin-generic": profiles.render_apparmor(
            "generic", mountpoint="/mnt/x").replace("/mnt/x", "/proc/x").encode(),
    }


@needs_parser
def test_by_default_only_this_versions_preset_profiles_are_installed(tmp_path: Path
                                                                     ) -> None:
    report = installer_for(tmp_path, mixed_source(), custom=False).sync()
    assert sorted(report.rejected) == sorted(
        ["custom.json", "fuse-device-plugin-generic", "s3fs.json", TEAM])
    for name in ("fuse-device-plugin-generic", "s3fs.json"):
        assert report.rejected[name].startswith(
            f"not what fuse-device-plugin {__version__} generates for preset ")
        assert "--allow-custom-profiles" in report.rejected[name]
    for name in (TEAM, "custom.json"):
        assert report.rejected[name].startswith("not a preset profile")
    assert sorted(report.installed) == sorted(
        ["fuse-device-plugin-s3fs", SSHFS, "fuse-device-plugin-lxcfs",
         "fuse-device-plugin-rootless-build", "generic.json", "sshfs.json", "lxcfs.json",
         "rootless-build.json"])


@needs_parser
def test_allow_custom_profiles_installs_safe_profiles_of_ones_own(tmp_path: Path) -> None:
    report = installer_for(tmp_path, mixed_source(), custom=True).sync()
    assert report.rejected == {}
    assert TEAM in report.installed
    assert "custom.json" in report.installed


@needs_parser
def test_the_shipped_configmap_installs_by_default(tmp_path: Path) -> None:
    manifest = Path(__file__).resolve().parents[2] / "manifests/profiles-configmap.yaml"
    data = yaml.safe_load(manifest.read_text())["data"]
    report = installer_for(tmp_path, {k: v.encode() for k, v in data.items()},
                           custom=False).sync()
    assert report.rejected == {}
    assert sorted(report.installed) == sorted(data)


@needs_parser
def test_install_once_flag_and_lint_say_which_mode_takes_a_file(tmp_path: Path) -> None:
    source, dest = tmp_path / "source", tmp_path / "node"
    source.mkdir()
    (source / "custom.json").write_text(CUSTOM_SECCOMP)
    done = install_once(source, dest)
    assert done.returncode == 1
    assert "--allow-custom-profiles" in done.stderr
    assert install_once(source, dest, "--allow-custom-profiles").returncode == 0
    assert (dest / "seccomp" / "custom.json").read_text() == CUSTOM_SECCOMP

    (source / "s3fs.json").write_text(profiles.render_seccomp("s3fs"))
    done = run("profile", "lint", str(source / "custom.json"), str(source / "s3fs.json"))
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        f"{source / 'custom.json'}: ok (install-profiles installs it only with "
        "--allow-custom-profiles: not a preset profile)",
        f"{source / 's3fs.json'}: ok"]
