"""Every generated AppArmor profile passes the real ``apparmor_parser``; broken ones do not.

``-Q -K`` parses and compiles without loading, so this runs on kernels without AppArmor.
Without kernel features the parser only checks mount rules' syntax ("mount rules not
enforced"); with Debian's pinned feature set (``-M``, from the apparmor package) it
compiles them into the policy DFA as a kernel with mount mediation would.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from fuse_plugin import profiles

PARSER = shutil.which("apparmor_parser") or (
    "/usr/sbin/apparmor_parser" if Path("/usr/sbin/apparmor_parser").exists() else None)
FEATURES = Path("/usr/share/apparmor-features/features")

pytestmark = pytest.mark.skipif(
    PARSER is None,
    reason="apparmor_parser not installed (Debian package 'apparmor'; scripts/install "
           "installs it): AppArmor profiles were not parse-checked")

VARIANTS = [(preset, None, None) for preset in sorted(profiles.PRESETS)] + [
    ("s3fs", None, "/mnt/s3"),
    ("sshfs", "team-a-sshfs", "/home/*/remote/**"),
    ("generic", "rclone", "/mnt/*"),
    ("lxcfs", None, "/var/lib/lxcfs/"),
]


def parse(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert PARSER is not None
    return subprocess.run([PARSER, "-Q", "-K", *extra, str(path)], capture_output=True,
                          text=True, timeout=60, check=False)


def feature_sets() -> list[tuple[str, ...]]:
    sets: list[tuple[str, ...]] = [()]
    if FEATURES.is_file():
        sets.append(("-M", str(FEATURES), "--warn=rule-not-enforced"))
    return sets


@pytest.mark.parametrize(("preset", "name", "mountpoint"), VARIANTS)
@pytest.mark.parametrize("features", feature_sets(), ids=lambda f: "pinned" if f else "plain")
def test_generated_profile_parses(tmp_path: Path, preset: str, name: str | None,
                                  mountpoint: str | None, features: tuple[str, ...]) -> None:
    path = tmp_path / (name or profiles.apparmor_name(preset))
    path.write_text(profiles.render_apparmor(preset, name, mountpoint))
    result = parse(path, *features)
    assert result.returncode == 0, result.stderr
    if features:
        assert "mount rules not enforce" not in result.stderr, result.stderr
        assert "error" not in result.stderr.lower(), result.stderr


def test_pinned_features_compile_the_mount_rules(tmp_path: Path) -> None:
    """With mount mediation in the feature set the FUSE rules reach the compiled policy."""
    if not FEATURES.is_file():
        pytest.skip(f"{FEATURES} missing: cannot compile against a pinned feature set")
    assert PARSER is not None
    path = tmp_path / "p"
    path.write_text(profiles.render_apparmor("s3fs"))
    without = path.with_name("q")
    without.write_text("\n".join(line for line in path.read_text().splitlines()
                                 if not line.strip().startswith("mount fstype=fuse")))

    def compiled(p: Path) -> bytes:
        return subprocess.run([PARSER, "-Q", "-K", "-M", str(FEATURES), "-S", str(p)],
                              capture_output=True, timeout=60, check=True).stdout

    assert len(compiled(path)) > len(compiled(without))


BROKEN = {
    "missing comma": ("  umount /**,", "  umount /**"),
    "unknown mount option": ("options=(rw,nosuid,nodev) ->", "options=(rw,nosuid,bogus) ->"),
    "unbalanced brace": ("\n}\n", "\n"),
    "unknown rule": ("  file,", "  flie,"),
    "unknown capability": ("  capability,", "  capability sys_fly,"),
}


@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_broken_profile_fails_to_parse(tmp_path: Path, breakage: str) -> None:
    old, new = BROKEN[breakage]
    text = profiles.render_apparmor("s3fs")
    assert old in text
    path = tmp_path / "broken"
    path.write_text(text.replace(old, new, 1))
    for features in feature_sets():
        result = parse(path, *features)
        assert result.returncode != 0, f"{breakage}: parser accepted it\n{result.stderr}"


# -- what the compiled mount rules decide -------------------------------------------------
#
# `apparmor_parser -D rule-exprs` prints each rule as the expression it adds to the policy
# DFA. For a mount the kernel walks that DFA over the mountpoint, NUL, the source, NUL, the
# filesystem type, NUL, then one byte per set mount flag (bit number + 1) and allows the
# mount when a rule with the mount permission matches and no deny rule does. Matching the
# printed expressions the same way answers "would this mount(2) pass?" without a kernel:
# the VM stage (tests/test_apparmor_vm.py) asks the real one.

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
AA_MAY_MOUNT = 0x2
RULE_EXPR = re.compile(r"^rule: (\\x07\S*)  ->  .*?(?P<deny> deny)? \((?P<perms>0x[0-9a-f]+)/")


@dataclass(frozen=True)
class MountRules:
    allow: tuple[re.Pattern[bytes], ...]
    deny: tuple[re.Pattern[bytes], ...]

    def allows(self, target: str, source: str, fstype: str, flags: int) -> bool:
        """As the kernel's mount check: the fields NUL-separated, then the flag bytes."""
        flag_bytes = bytes(bit + 1 for bit in range(32) if flags & (1 << bit))
        walked = b"\x07" + b"\x00".join(
            s.encode() for s in (target, source, fstype)) + b"\x00" + flag_bytes
        return (any(p.fullmatch(walked) for p in self.allow)
                and not any(p.fullmatch(walked) for p in self.deny))


def compiled_mount_rules(tmp_path: Path, preset: str, mountpoint: str | None = None) -> MountRules:
    if not FEATURES.is_file():
        pytest.skip(f"{FEATURES} missing: mount rules compile only with a feature set")
    assert PARSER is not None
    path = tmp_path / preset
    path.write_text(profiles.render_apparmor(preset, None, mountpoint))
    out = subprocess.run([PARSER, "-Q", "-K", "-M", str(FEATURES), "-D", "rule-exprs", str(path)],
                         capture_output=True, text=True, timeout=60, check=True)
    allow: list[re.Pattern[bytes]] = []
    deny: list[re.Pattern[bytes]] = []
    for line in (out.stdout + out.stderr).splitlines():
        m = RULE_EXPR.match(line)
        if m and int(m.group("perms"), 16) & AA_MAY_MOUNT:
            (deny if m.group("deny") else allow).append(re.compile(m.group(1).encode()))
    if not allow or not deny:
        pytest.skip("this apparmor_parser prints no mount rule expressions with -D rule-exprs")
    return MountRules(tuple(allow), tuple(deny))


LXCFS_FILE = "/var/lib/lxcfs/proc/meminfo"


def test_lxcfs_rules_let_exactly_its_files_be_bound_over_proc(tmp_path: Path) -> None:
    rules = compiled_mount_rules(tmp_path, "lxcfs")
    for name in profiles.presets.LXCFS_PROC_FILES:
        assert rules.allows(f"/proc/{name}", f"/var/lib/lxcfs/proc/{name}", "", MS_BIND), name
        assert not rules.allows(f"/proc/{name}", f"/var/lib/lxcfs/proc/{name}", "",
                                MS_BIND | MS_REC), name
    # lxcfs's own start-up mounts and its FUSE mount still pass beside the narrowed denials.
    assert rules.allows("/", "", "", MS_REC | MS_PRIVATE)
    assert rules.allows("/run/lxcfs/root/", "/", "", MS_BIND)
    assert rules.allows("/var/lib/lxcfs/", "lxcfs", "fuse.lxcfs", MS_NOSUID | MS_NODEV)
    refused = {
        "another file over /proc/meminfo": ("/proc/meminfo", "/etc/hostname", "", MS_BIND),
        "a served file over another": ("/proc/cpuinfo", LXCFS_FILE, "", MS_BIND),
        "over a file lxcfs does not serve": ("/proc/version", LXCFS_FILE, "", MS_BIND),
        "over /proc/sys": ("/proc/sys/", "/etc/", "", MS_BIND),
        "over /proc/self/attr": ("/proc/1/attr/", "/etc/", "", MS_BIND),
        "over /dev/null": ("/dev/null", "/etc/hostname", "", MS_BIND),
        "tmpfs on /proc": ("/proc/", "tmpfs", "tmpfs", MS_NOSUID | MS_NODEV),
        "tmpfs on /proc/meminfo": ("/proc/meminfo", "tmpfs", "tmpfs", 0),
        "fuse on /proc/meminfo": ("/proc/meminfo", "lxcfs", "fuse.lxcfs", MS_NOSUID | MS_NODEV),
        "a new mount named like a bind": ("/proc/meminfo", LXCFS_FILE, "proc", 0),
        "a move onto /proc/meminfo": ("/proc/meminfo", "/mnt/x/", "", MS_MOVE),
        "remount /sys rw": ("/sys/", "", "", MS_REMOUNT),
        "remount /proc ro": ("/proc/", "", "", MS_REMOUNT | MS_RDONLY),
        # AppArmor 3.0 reads options=(rw,bind) as the bind plus any flagless mount there.
        "procfs where only a bind is allowed": ("/run/lxcfs/root/", "/", "proc", 0),
        "procfs over / (rw,rprivate)": ("/", "proc", "proc", 0),
    }
    for what, mount in refused.items():
        assert not rules.allows(*mount), what


def test_lxcfs_binds_follow_its_mountpoint(tmp_path: Path) -> None:
    rules = compiled_mount_rules(tmp_path, "lxcfs", "/srv/lxcfs/")
    assert rules.allows("/proc/meminfo", "/srv/lxcfs/proc/meminfo", "", MS_BIND)
    assert not rules.allows("/proc/meminfo", LXCFS_FILE, "", MS_BIND)
    assert not rules.allows("/proc/meminfo", "lxcfs", "fuse.lxcfs", MS_NOSUID | MS_NODEV)


@pytest.mark.parametrize("preset", ["s3fs", "sshfs", "generic"])
def test_fuse_presets_refuse_every_mount_on_proc(tmp_path: Path, preset: str) -> None:
    rules = compiled_mount_rules(tmp_path, preset)
    assert rules.allows("/mnt/data/", "fdp", "fuse", MS_NOSUID | MS_NODEV)
    assert not rules.allows("/proc/meminfo", LXCFS_FILE, "", MS_BIND)
    assert not rules.allows("/proc/meminfo", "fdp", "fuse", MS_NOSUID | MS_NODEV)
    assert not rules.allows("/proc/", "tmpfs", "tmpfs", MS_NOSUID | MS_NODEV)


MS_NOEXEC, MS_SLAVE, MS_SHARED, MS_STRICTATIME = 8, 1 << 19, 1 << 20, 1 << 24
NOSUID_NODEV_NOEXEC = MS_NOSUID | MS_NODEV | MS_NOEXEC
LAYER = "/storage/graph/overlay/0123abcd/merged/"


def test_rootless_build_rules_pass_what_buildah_and_podman_mount(tmp_path: Path) -> None:
    """The mount(2) calls strace saw buildah, podman and runc make for a build and a run
    (tests/containers/test_rootless_build.py), with the flags AppArmor compares: for a
    bind only bind/rec, for a propagation change only its type and rec."""
    rules = compiled_mount_rules(tmp_path, "rootless-build")
    seen = {
        "an overlay layer stack": (LAYER, "overlay", "overlay", 0),
        "fuse-overlayfs instead": (LAYER, "fuse-overlayfs", "fuse.fuse-overlayfs",
                                   MS_NOSUID | MS_NODEV),
        "runc's /proc": (LAYER + "proc/", "proc", "proc", NOSUID_NODEV_NOEXEC),
        "runc's /dev": (LAYER + "dev/", "tmpfs", "tmpfs",
                        MS_NOSUID | MS_NOEXEC | MS_STRICTATIME),
        "/dev/pts": (LAYER + "dev/pts/", "devpts", "devpts", MS_NOSUID | MS_NOEXEC),
        "/dev/mqueue": (LAYER + "dev/mqueue/", "mqueue", "mqueue", NOSUID_NODEV_NOEXEC),
        "a mask over a /proc directory": ("/proc/acpi/", "tmpfs", "tmpfs", MS_RDONLY),
        "a mask over a /proc file": ("/proc/kcore", "/dev/null", "", MS_BIND),
        "/sys, bound read-only": (LAYER + "sys/", "/sys/", "", MS_BIND | MS_REC),
        "its remount": (LAYER + "sys/", "", "",
                        MS_RDONLY | NOSUID_NODEV_NOEXEC | MS_REMOUNT | MS_BIND | MS_REC),
        "a read-only path": ("/proc/sys/", "", "",
                             MS_RDONLY | NOSUID_NODEV_NOEXEC | MS_REMOUNT | MS_BIND),
        "runc's sealed copy of itself": ("/storage/xdg/runc/x/runc.y", "", "",
                                         MS_RDONLY | MS_REMOUNT | MS_BIND),
        "/dev/shm remount": (LAYER + "dev/shm/", "", "",
                             NOSUID_NODEV_NOEXEC | MS_REMOUNT | MS_BIND),
        "/ made private": ("/", "", "", MS_REC | MS_PRIVATE),
        "/ made a slave": ("/", "", "", MS_REC | MS_SLAVE),
        "the storage directory private": ("/storage/graph/overlay/", "", "", MS_PRIVATE),
        "the storage directory onto itself": ("/storage/graph/overlay/",
                                              "/storage/graph/overlay/", "", MS_BIND),
    }
    for what, mount in seen.items():
        assert rules.allows(*mount), what
    refused = {
        "fuseblk": ("/mnt/", "/dev/vda", "fuseblk", MS_NOSUID | MS_NODEV),
        "another FUSE type": ("/mnt/", "x", "fuse.sshfs", MS_NOSUID | MS_NODEV),
        "fuse-overlayfs with set-uid files": (LAYER, "fuse-overlayfs", "fuse.fuse-overlayfs",
                                              MS_NODEV),
        "sysfs": ("/mnt/", "sysfs", "sysfs", 0),
        "sysfs as runc would mount it": ("/mnt/", "sysfs", "sysfs", MS_NOSUID | MS_NODEV),
        "cgroup v1": ("/mnt/", "cgroup", "cgroup", 0),
        # With --cgroupns host neither tool asks for one (runc binds /sys instead).
        "cgroup2": (LAYER + "sys/fs/cgroup/", "cgroup2", "cgroup2", 0),
        "binfmt_misc": ("/mnt/", "binfmt_misc", "binfmt_misc", 0),
        "proc without nosuid,nodev,noexec": ("/mnt/", "proc", "proc", 0),
        "a move": ("/mnt/", "/storage/", "", MS_MOVE),
        "a shared mount": ("/", "", "", MS_SHARED),
        "a remount read-write": ("/proc/sys/", "", "", MS_REMOUNT | MS_BIND),
        "a plain remount": ("/", "", "", MS_REMOUNT),
    }
    for what, mount in refused.items():
        assert not rules.allows(*mount), what
    # AppArmor 3.0 also reads each remount rule as a new mount of any type with exactly
    # its other flags (see lint._widened): sysfs read-only, say. The kernel refuses those
    # that matter: sysfs and cgroup need a network or cgroup namespace of one's own, which
    # the seccomp profile never lets the build create.
    assert rules.allows("/mnt/", "sysfs", "sysfs", MS_RDONLY)
    assert rules.allows("/mnt/", "cgroup2", "cgroup2", NOSUID_NODEV_NOEXEC)


@pytest.mark.parametrize("preset", sorted(profiles.PRESETS))
def test_profile_parses_with_an_empty_apparmor_d(tmp_path: Path, preset: str) -> None:
    """In the installer's pod /etc/apparmor.d is the node's: empty on a node without
    AppArmor's tools, where the profiles are still parse-checked. Nothing they name may
    come from there (an `abi` or `include` would)."""
    base = tmp_path / "apparmor.d"
    base.mkdir()
    path = tmp_path / profiles.apparmor_name(preset)
    path.write_text(profiles.render_apparmor(preset))
    result = parse(path, "--base", str(base))
    assert result.returncode == 0, result.stderr
