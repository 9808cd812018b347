"""The runtime-default seccomp profile the container tests attack with is containers-common's
file converted as the engine, runc and libseccomp would for one container: capability,
architecture and kernel conditions, errnos, and which of two rules for one call wins.
The last tests load it into libseccomp and run a real child process under it.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.lib import oci, profiles, seccomp_probe
from tests.lib import runtime_default as rd

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(seccomp_probe.__file__)
MARKER = 3999  # what refusals by the default action return in the probe's runs
CAP_SYS_CHROOT_BIT = 18
AMD64 = rd.Host("amd64", "SCMP_ARCH_X86_64", (6, 1))
ARM64 = rd.Host("arm64", "SCMP_ARCH_AARCH64", (6, 1))
RISCV = rd.Host("riscv64", "SCMP_ARCH_RISCV64", (6, 1))
WITHOUT_CHROOT = tuple(c for c in oci.DEFAULT_CAPABILITIES if c != "CAP_SYS_CHROOT")


def source() -> dict[str, Any]:
    return rd.read_source()


def profile(capabilities: Iterable[str] = oci.DEFAULT_CAPABILITIES,
            host: rd.Host | None = None) -> dict[str, Any]:
    return rd.resolve(rd.convert(source(), capabilities, host or rd.this_host()))


def names(profile: dict[str, Any]) -> set[str]:
    return {name for rule in profile["syscalls"] for name in rule["names"]}


def rules_naming(name: str) -> list[dict[str, Any]]:
    return [rule for rule in source()["syscalls"] if name in rule["names"]]


def synthetic(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": errno.ENOSYS,
            "syscalls": list(rules)}


def bpf(profile: dict[str, Any]) -> bytes:
    """The filter libseccomp builds from ``profile``, loaded the way runc loads it."""
    flt, skipped = seccomp_probe.build_filter(profile, None)
    assert skipped == []
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


# --- capabilities -----------------------------------------------------------------------

def test_containerd_default_caps_are_the_default() -> None:
    assert profiles.DEFAULT_CAPS == oci.DEFAULT_CAPABILITIES
    assert "CAP_SYS_CHROOT" in profiles.DEFAULT_CAPS
    assert "CAP_SYS_ADMIN" not in profiles.DEFAULT_CAPS
    assert json.loads(profiles.runtime_default()) == profile()


def test_chroot_is_allowed_with_cap_sys_chroot() -> None:
    assert rd.outcome(profile(), "chroot") == ("SCMP_ACT_ALLOW", None)
    assert rd.outcome(profile(["CAP_SYS_CHROOT"]), "chroot") == ("SCMP_ACT_ALLOW", None)


def test_chroot_is_refused_with_the_files_errno_without_the_cap() -> None:
    refusal = [r for r in rules_naming("chroot") if "CAP_SYS_CHROOT" in
               (r.get("excludes") or {}).get("caps", ())]
    assert len(refusal) == 1
    assert refusal[0]["action"] == "SCMP_ACT_ERRNO"
    assert refusal[0]["errnoRet"] == errno.EPERM
    for caps in (WITHOUT_CHROOT, ()):
        assert rd.outcome(profile(caps), "chroot") == ("SCMP_ACT_ERRNO", errno.EPERM)


def test_mount_is_as_the_file_says() -> None:
    """The file names mount once, in its unconditional allow list: every container may
    call it, and only the missing CAP_SYS_ADMIN stops it in the kernel."""
    (rule,) = rules_naming("mount")
    assert rule["action"] == "SCMP_ACT_ALLOW"
    assert not rule.get("args")
    assert not rule.get("includes")
    assert not rule.get("excludes")
    for caps in (oci.DEFAULT_CAPABILITIES, (), oci.ALL_CAPABILITIES):
        assert rd.outcome(profile(caps), "mount") == ("SCMP_ACT_ALLOW", None)


def test_includes_need_every_cap_and_excludes_any() -> None:
    both = {"names": ["acct"], "action": "SCMP_ACT_ALLOW",
            "includes": {"caps": ["CAP_A", "CAP_B"]}}
    unless = {"names": ["vhangup"], "action": "SCMP_ACT_ALLOW",
              "excludes": {"caps": ["CAP_A", "CAP_B"]}}
    for caps, expected in ((["CAP_A"], set()), (["CAP_B"], set()), ([], {"vhangup"}),
                           (["CAP_A", "CAP_B"], {"acct"})):
        assert names(rd.convert(synthetic(both, unless), caps, AMD64)) == expected, caps


def test_capability_pairs_in_the_file_are_exclusive() -> None:
    """Each capability-dependent allow has its refusal for the other case: with all caps
    none of the refusals apply, with none every allow is gone."""
    with_all = profile(oci.ALL_CAPABILITIES)
    assert rd.outcome(with_all, "open_by_handle_at") == ("SCMP_ACT_ALLOW", None)
    assert rd.outcome(with_all, "bpf") == ("SCMP_ACT_ALLOW", None)
    with_none = profile(())
    assert rd.outcome(with_none, "open_by_handle_at") == ("SCMP_ACT_ERRNO", errno.EPERM)
    assert rd.outcome(with_none, "bpf") == ("SCMP_ACT_ERRNO", errno.EPERM)


# --- architecture, kernel, errnos ------------------------------------------------------------

def test_arch_rules_and_arch_map_follow_the_machine() -> None:
    amd64, arm64 = profile(host=AMD64), profile(host=ARM64)
    assert amd64["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    assert arm64["architectures"] == ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]
    assert {"arch_prctl", "modify_ldt"} <= names(amd64)
    assert not {"arch_prctl", "modify_ldt"} & names(arm64)
    assert {"set_tls", "cacheflush", "arm_fadvise64_64"} <= names(arm64)
    assert not {"set_tls", "cacheflush", "s390_runtime_instr"} & names(amd64)
    # A machine the archMap does not list gets no architectures: libseccomp's native one.
    assert "architectures" not in profile(host=RISCV)


def test_excluded_arch_drops_the_rule() -> None:
    rule = {"names": ["acct"], "action": "SCMP_ACT_ALLOW", "excludes": {"arches": ["amd64"]}}
    assert names(rd.convert(synthetic(rule), (), AMD64)) == set()
    assert names(rd.convert(synthetic(rule), (), ARM64)) == {"acct"}


def test_this_host_is_the_running_machine() -> None:
    host = rd.this_host()
    assert host.kernel == rd.parse_kernel(os.uname().release)
    assert rd.NATIVE_ARCHES[os.uname().machine] == (host.arch, host.seccomp_arch)


@pytest.mark.parametrize(("release", "version"), [
    ("6.18.44-fc-v669", (6, 18)), ("3.12-1-amd64", (3, 12)), ("5.8", (5, 8))])
def test_kernel_release_is_read_as_major_minor(release: str, version: rd.KernelVersion
                                               ) -> None:
    assert rd.parse_kernel(release) == version


@pytest.mark.parametrize(("kernel", "included", "excluded"), [
    ((5, 7), False, True), ((5, 8), True, False), ((5, 10), True, False),
    ((6, 0), True, False), ((4, 19), False, True)])
def test_min_kernel(kernel: rd.KernelVersion, included: bool, excluded: bool) -> None:
    """``includes.minKernel`` needs the kernel at least that new; ``excludes.minKernel``
    drops the rule when it is (moby's semantics, compared on major.minor)."""
    host = rd.Host("amd64", "SCMP_ARCH_X86_64", kernel)
    new = {"names": ["acct"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "5.8"}}
    old = {"names": ["vhangup"], "action": "SCMP_ACT_ALLOW",
           "excludes": {"minKernel": "5.8"}}
    got = names(rd.convert(synthetic(new, old), (), host))
    assert ("acct" in got, "vhangup" in got) == (included, excluded)


def test_errno_names_win_over_numbers() -> None:
    source = synthetic({"names": ["acct"], "action": "SCMP_ACT_ERRNO", "errno": "EXDEV",
                        "errnoRet": 1})
    del source["defaultErrnoRet"]
    source["defaultErrno"] = "ENOSYS"
    converted = rd.convert(source, (), AMD64)
    assert converted["defaultErrnoRet"] == errno.ENOSYS
    assert converted["syscalls"][0]["errnoRet"] == errno.EXDEV
    with pytest.raises(rd.RuntimeDefaultError, match="EBOGUS"):
        rd.convert({**source, "defaultErrno": "EBOGUS"}, (), AMD64)


def test_the_file_keeps_its_default_errno_and_per_rule_errnos() -> None:
    raw = source()
    converted = profile()
    assert converted["defaultAction"] == raw["defaultAction"] == "SCMP_ACT_ERRNO"
    assert converted["defaultErrnoRet"] == raw["defaultErrnoRet"] == errno.ENOSYS
    assert rd.outcome(converted, "add_key") == ("SCMP_ACT_ERRNO", errno.ENOSYS)
    assert rd.outcome(converted, "kexec_load") == ("SCMP_ACT_ERRNO", errno.EPERM)
    personality = [r for r in converted["syscalls"] if r["names"] == ["personality"]]
    assert [r["args"][0]["value"] for r in personality] == [0, 8, 0x20000, 0x20008,
                                                              0xFFFFFFFF]


def test_the_result_survives_containerds_loading() -> None:
    """No Docker-format key is left for containerd to drop without a word."""
    text = profiles.runtime_default()
    assert oci.load_seccomp(text) == json.loads(text)


def test_unknown_conditions_and_a_missing_file_fail_clearly(tmp_path: Path) -> None:
    odd = {"names": ["acct"], "action": "SCMP_ACT_ALLOW", "includes": {"maxKernel": "9.0"}}
    with pytest.raises(rd.RuntimeDefaultError, match="maxKernel"):
        rd.convert(synthetic(odd), (), AMD64)
    with pytest.raises(rd.RuntimeDefaultError, match=rd.SOURCE_PACKAGE):
        rd.runtime_default((), path=tmp_path / "seccomp.json")


def test_the_file_comes_from_a_listed_package() -> None:
    owner = subprocess.run(["dpkg-query", "-S", str(rd.SOURCE)], capture_output=True,
                           text=True, check=False)
    assert owner.returncode == 0, owner.stderr
    assert owner.stdout.split(":", 1)[0] == rd.SOURCE_PACKAGE
    listed = (ROOT / "scripts" / "apt-packages.txt").read_text().split()
    assert rd.SOURCE_PACKAGE in listed


# --- two rules for one call: what runc and libseccomp do -------------------------------------

def test_first_unconditional_rule_wins() -> None:
    """libseccomp keeps the first unconditional rule for a call and drops later ones: the
    resolved profile builds the same filter as the unresolved one, and as the first rule
    alone, not as the second."""
    allow = {"names": ["setns"], "action": "SCMP_ACT_ALLOW"}
    refuse = {"names": ["setns"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    for first, second in ((allow, refuse), (refuse, allow)):
        both = synthetic(first, second)
        assert rd.resolve(both) == synthetic(first)
        assert bpf(both) == bpf(synthetic(first))
        assert bpf(both) != bpf(synthetic(second))


def test_a_later_unconditional_rule_replaces_conditional_ones() -> None:
    some = {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": 8, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]}
    refuse = {"names": ["personality"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    both = synthetic(some, refuse)
    assert rd.resolve(both) == synthetic(refuse)
    assert bpf(both) == bpf(synthetic(refuse))
    # ... while a conditional rule after an unconditional one is dropped.
    assert rd.resolve(synthetic(refuse, some)) == synthetic(refuse)
    assert bpf(synthetic(refuse, some)) == bpf(synthetic(refuse))


def test_a_rule_equal_to_the_default_is_skipped_as_runc_does() -> None:
    same = {"names": ["acct"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS}
    assert rd.resolve(synthetic(same)) == synthetic()


@pytest.mark.parametrize("capabilities", [oci.DEFAULT_CAPABILITIES, (),
                                          oci.ALL_CAPABILITIES])
def test_resolution_builds_the_filter_runc_would(capabilities: tuple[str, ...]) -> None:
    converted = rd.convert(source(), capabilities, rd.this_host())
    assert bpf(rd.resolve(converted)) == bpf(converted)


def test_setns_is_allowed_without_cap_sys_admin() -> None:
    """The file's allow list names setns before its CAP_SYS_ADMIN-less refusal: the
    refusal never takes effect (the kernel's own capability checks still do)."""
    assert [r["action"] for r in rules_naming("setns")] == [
        "SCMP_ACT_ALLOW", "SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"]
    assert rd.outcome(profile(), "setns") == ("SCMP_ACT_ALLOW", None)


# --- a real child process under the filter ---------------------------------------------------

def probe(tmp_path: Path, profile: dict[str, Any]) -> dict[str, int]:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    done = subprocess.run([sys.executable, str(PROBE), str(path), str(tmp_path / "f.bpf"),
                           "--errno", str(MARKER)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["skipped"] == []
    results: dict[str, int] = report["results"]
    return results


def test_a_child_under_the_default_caps_profile(tmp_path: Path) -> None:
    results = probe(tmp_path, profile())
    # Through the filter: the kernel fails the NULL pointers and the bad fd itself.
    assert results["chroot"] == errno.EFAULT
    assert results["mount"] == results["umount2"] == errno.EFAULT
    assert results["setns"] == errno.EBADF
    assert results["unshare"] == 0
    assert results["clone3"] == errno.EINVAL
    # Refused by the file's own rules, with their errno.
    for refused in ("open_by_handle_at", "bpf", "kexec_load", "init_module"):
        assert results[refused] == errno.EPERM, refused
    # Refused by the default action.
    assert results["personality_exec"] == MARKER
    assert results["personality_query"] == 0


def test_a_child_without_cap_sys_chroot_gets_eperm(tmp_path: Path) -> None:
    results = probe(tmp_path, profile(WITHOUT_CHROOT))
    assert results["chroot"] == errno.EPERM
    assert results["mount"] == errno.EFAULT


CHROOT_CHILD = """
import ctypes, json, sys
from tests.lib import seccomp_probe
flt, _ = seccomp_probe.build_filter(json.loads(sys.argv[1]), None)
flt.load()
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.chroot(sys.argv[2].encode())
sys.stdout.write(json.dumps(ctypes.get_errno() if rc else 0))
"""


def chroot_under(profile: dict[str, Any], directory: Path) -> int:
    """The errno of a real chroot(2) into ``directory`` by a child under ``profile``."""
    done = subprocess.run([sys.executable, "-c", CHROOT_CHILD, json.dumps(profile),
                           str(directory)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    result: int = json.loads(done.stdout)
    return result


def has_cap_sys_chroot() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_CHROOT_BIT & 1)
    return False


@pytest.mark.skipif(not has_cap_sys_chroot(), reason="chroot(2) needs CAP_SYS_CHROOT here")
def test_a_child_really_chroots_with_the_cap_and_not_without(tmp_path: Path) -> None:
    assert chroot_under(profile(), tmp_path) == 0
    assert chroot_under(profile(WITHOUT_CHROOT), tmp_path) == errno.EPERM
