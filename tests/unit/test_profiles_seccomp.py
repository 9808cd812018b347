"""Every generated seccomp profile loads into libseccomp, exports BPF, and behaves: each
profile is applied to a real child process (tests/lib/seccomp_probe.py) that then makes the
system calls and reports the errno the kernel (or the filter) gave it.

Refusals by the profile's default action are made to return a marker errno (3999) in
most runs so they cannot be confused with the kernel's own EPERM; one run keeps the
profile's own default (EPERM) to show that is what a container sees.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fuse_plugin import profiles

PROBE = Path(__file__).parents[1] / "lib" / "seccomp_probe.py"
MARKER = 3999
FUSE_PRESETS = ["generic", "s3fs", "sshfs"]


def probe(tmp_path: Path, preset: str, marker: bool = True) -> dict[str, Any]:
    profile = tmp_path / f"{preset}.json"
    profile.write_text(profiles.render_seccomp(preset))
    bpf = tmp_path / f"{preset}.bpf"
    argv = [sys.executable, str(PROBE), str(profile), str(bpf)]
    if marker:
        argv += ["--errno", str(MARKER)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    # A missing pyseccomp (dev extras) or libseccomp2 fails here, loudly: no skipping.
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    report["bpf"] = bpf.read_bytes()
    return report


@pytest.mark.parametrize("preset", sorted(profiles.PRESETS))
def test_profile_loads_and_exports_bpf(tmp_path: Path, preset: str) -> None:
    report = probe(tmp_path, preset)
    # Every name resolves on this architecture or is a pseudo-syscall libseccomp maps for
    # the profile's other architectures; nothing is silently skipped as runc would.
    assert report["skipped"] == []
    bpf: bytes = report["bpf"]
    assert len(bpf) > 64
    assert len(bpf) % 8 == 0
    assert report["results"]["getpid"] == 0


@pytest.mark.parametrize("preset", FUSE_PRESETS)
def test_fuse_presets_allow_mount_and_refuse_the_rest(tmp_path: Path, preset: str) -> None:
    results = probe(tmp_path, preset)["results"]
    # Let through to the kernel, which fails the NULL pointers with EFAULT.
    assert results["mount"] == errno.EFAULT
    assert results["umount2"] == errno.EFAULT
    assert results["clone_plain"] == errno.EINVAL
    assert results["personality_query"] == 0
    # Refused by the filter, as by the runtime default.
    for refused in ("kexec_load", "open_by_handle_at", "bpf", "unshare", "setns",
                    "pivot_root", "chroot", "clone_newns", "personality_exec", "reboot",
                    "init_module"):
        assert results[refused] == MARKER, refused
    # clone3 answers ENOSYS so glibc falls back to the flag-checked clone().
    assert results["clone3"] == errno.ENOSYS


def test_refusals_are_eperm_as_in_a_container(tmp_path: Path) -> None:
    results = probe(tmp_path, "s3fs", marker=False)["results"]
    for refused in ("kexec_load", "open_by_handle_at", "bpf", "unshare"):
        assert results[refused] == errno.EPERM, refused
    assert results["mount"] == errno.EFAULT


def test_lxcfs_gets_its_namespace_calls(tmp_path: Path) -> None:
    results = probe(tmp_path, "lxcfs")["results"]
    assert results["unshare"] == 0  # unshare(0) is a no-op once allowed
    assert results["setns"] == errno.EBADF
    assert results["pivot_root"] == errno.EFAULT
    assert results["chroot"] == errno.EFAULT
    assert results["clone_newns"] == errno.EINVAL  # through the filter, refused by the kernel
    assert results["clone3"] == errno.EINVAL
    assert results["mount"] == results["umount2"] == errno.EFAULT
    for refused in ("kexec_load", "open_by_handle_at", "bpf", "reboot", "init_module",
                    "personality_exec"):
        assert results[refused] == MARKER, refused


def test_rootless_build_lets_a_build_make_its_namespaces_and_nothing_more(
        tmp_path: Path) -> None:
    results = probe(tmp_path, "rootless-build")["results"]
    # Through the filter; the kernel then refuses the harmless arguments.
    assert results["clone_newuser"] == errno.EINVAL
    assert results["clone_newns"] == errno.EINVAL
    assert results["unshare_newuser_newns"] == errno.EINVAL
    assert results["unshare"] == 0
    assert results["mount"] == results["umount2"] == results["pivot_root"] == errno.EFAULT
    assert results["chroot"] == errno.EFAULT
    assert results["setns"] == errno.EBADF
    assert results["sethostname"] == errno.EINVAL
    # clone3 and keyctl answer ENOSYS: glibc falls back to clone(), runc goes on without
    # a session keyring; neither reaches the kernel.
    assert results["clone3"] == errno.ENOSYS
    assert results["keyctl"] == errno.ENOSYS
    # Refused by the filter: the other namespaces, and what the runtime default refuses.
    for refused in ("clone_newnet", "clone_newcgroup", "unshare_newnet", "unshare_newcgroup",
                    "unshare_newtime", "fsopen", "io_uring_setup", "kexec_load",
                    "open_by_handle_at", "bpf", "reboot", "init_module", "personality_exec"):
        assert results[refused] == MARKER, refused


@pytest.mark.parametrize("preset", FUSE_PRESETS)
def test_fuse_presets_make_no_user_namespace(tmp_path: Path, preset: str) -> None:
    results = probe(tmp_path, preset)["results"]
    for refused in ("clone_newuser", "unshare_newuser_newns", "sethostname", "keyctl"):
        assert results[refused] == MARKER, refused
