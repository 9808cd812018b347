"""Every generated AppArmor profile passes the real ``apparmor_parser``; broken ones do not.

``-Q -K`` parses and compiles without loading, so this runs on kernels without AppArmor.
Without kernel features the parser only checks mount rules' syntax ("mount rules not
enforced"); with Debian's pinned feature set (``-M``, from the apparmor package) it
compiles them into the policy DFA as a kernel with mount mediation would.
"""

from __future__ import annotations

import shutil
import subprocess
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
