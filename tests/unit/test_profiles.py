"""Profile generation, validation, lint and the ``profile`` command (no kernel needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fuse_plugin import cli, profiles
from fuse_plugin.profiles import apparmor, lint, presets, seccomp, validate
from tests.lib import oci

PRESETS = sorted(profiles.PRESETS)
FUSE_PRESETS = [name for name in PRESETS if name not in ("lxcfs", "rootless-build")]


def allowed(profile: dict[str, object], *, with_args: bool = False) -> set[str]:
    """Names with an unconditional SCMP_ACT_ALLOW rule (or any ALLOW rule: with_args)."""
    names: set[str] = set()
    for entry in profile["syscalls"]:  # type: ignore[attr-defined]
        if entry["action"] == "SCMP_ACT_ALLOW" and (with_args or not entry.get("args")):
            names.update(entry["names"])
    return names


# -- seccomp ------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_seccomp_is_runtime_default_plus_exactly_the_preset_extras(preset: str) -> None:
    profile = json.loads(profiles.render_seccomp(preset))
    base = set(seccomp.runtime_default_syscalls())
    extras = allowed(profile) - base
    expected = set(profiles.PRESETS[preset].syscalls)
    if preset == "lxcfs":
        expected |= {"clone", "clone3"}
    assert extras == expected
    assert base <= allowed(profile)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"


@pytest.mark.parametrize("preset", PRESETS)
def test_seccomp_is_pure_oci_json(preset: str) -> None:
    text = profiles.render_seccomp(preset)
    profile = json.loads(text)
    assert set(profile) == {"defaultAction", "architectures", "syscalls"}
    for entry in profile["syscalls"]:
        assert set(entry) <= {"names", "action", "args", "errnoRet"}, entry
    assert "includes" not in text
    assert "excludes" not in text
    assert "archMap" not in text
    assert lint.seccomp_text(text) == []
    assert text == profiles.render_seccomp(preset), "output must be stable"


@pytest.mark.parametrize("preset", FUSE_PRESETS)
def test_fuse_presets_keep_namespaces_closed(preset: str) -> None:
    profile = json.loads(profiles.render_seccomp(preset))
    names = allowed(profile)
    for refused in ("unshare", "setns", "pivot_root", "chroot", "bpf", "kexec_load",
                    "open_by_handle_at", "init_module", "clone3", "io_uring_setup"):
        assert refused not in names
    clone = [e for e in profile["syscalls"] if e["names"] == ["clone"]]
    assert clone[0]["args"] == [{"index": 0, "value": seccomp.CLONE_NAMESPACE_FLAGS,
                                 "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]
    clone3 = [e for e in profile["syscalls"] if e["names"] == ["clone3"]]
    assert clone3 == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]


def test_runtime_default_and_known_lists_are_consistent() -> None:
    base = seccomp.runtime_default_syscalls()
    assert len(base) == len(set(base)), "duplicates in runtime_default_syscalls.txt"
    assert set(base) <= seccomp.known_syscalls()
    assert "mount" not in base
    assert "io_uring_enter" not in base
    assert {"read", "write", "openat", "execve", "exit_group"} <= set(base)


def test_seccomp_lint_catches_what_runc_would_accept_silently() -> None:
    profile = json.loads(profiles.render_seccomp("s3fs"))
    profile["syscalls"].append({"names": ["mount", "mountt", "mountt"],
                                "action": "SCMP_ACT_ALLOW",
                                "includes": {"caps": ["CAP_SYS_ADMIN"]}})
    profile["archMap"] = []
    errors = lint.seccomp_profile(profile)
    assert any("unknown system call 'mountt'" in e for e in errors)
    assert any("'mountt' listed 2 times" in e for e in errors)
    assert any("'mount' has 2 rules" in e for e in errors)
    assert any("'includes' conditions are dropped" in e for e in errors)
    assert any("archMap" in e for e in errors)
    assert lint.seccomp_profile({"defaultAction": "SCMP_ACT_ALLOW", "architectures": [
        "SCMP_ARCH_X86_64"], "syscalls": []}) == [
        "defaultAction SCMP_ACT_ALLOW allows every system call not listed"]
    assert lint.seccomp_text("{nope")[0].startswith("not JSON")


# -- AppArmor -----------------------------------------------------------------------------

# -- rootless-build ------------------------------------------------------------------------

BUILD = "rootless-build"
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x08000000, 0x10000000, 0x20000000
CLONE_NEWNET, CLONE_NEWTIME = 0x40000000, 0x00000080


def rules_for(profile: dict[str, object], name: str) -> list[dict[str, object]]:
    return [e for e in profile["syscalls"] if name in e["names"]]  # type: ignore[attr-defined]


def passes(rules: list[dict[str, object]], flags: int) -> bool:
    """Whether an ALLOW rule lets the call through with ``flags`` as its first argument
    (the masked comparison libseccomp makes: arg & value == valueTwo)."""
    for rule in rules:
        if rule["action"] != "SCMP_ACT_ALLOW":
            continue
        args = rule.get("args") or []
        if all(flags & a["value"] == a["valueTwo"] for a in args):  # type: ignore[attr-defined]
            return True
    return False


def test_rootless_build_seccomp_adds_exactly_what_a_nested_build_needs() -> None:
    profile = json.loads(profiles.render_seccomp(BUILD))
    base = set(seccomp.runtime_default_syscalls())
    assert allowed(profile) - base == {"mount", "umount2", "pivot_root", "chroot",
                                       "sethostname", "setns"}
    # unshare/clone only with the namespaces a build makes: user (the re-exec), then
    # mount, UTS, IPC and PID (runc's container for RUN); never net, cgroup or time.
    for call in ("unshare", "clone"):
        rules = rules_for(profile, call)
        assert passes(rules, 0)
        for flags in (CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWUSER | CLONE_NEWNS,
                      CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID):
            assert passes(rules, flags), (call, hex(flags))
        for flags in (CLONE_NEWNET, CLONE_NEWCGROUP, CLONE_NEWUSER | CLONE_NEWNET,
                      CLONE_NEWNS | CLONE_NEWCGROUP):
            assert not passes(rules, flags), (call, hex(flags))
    assert not passes(rules_for(profile, "unshare"), CLONE_NEWTIME)
    assert rules_for(profile, "clone3") == [
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]
    # keyctl: ENOSYS, so runc goes on without a session keyring; never allowed.
    assert rules_for(profile, "keyctl") == [
        {"names": ["keyctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]
    names = allowed(profile, with_args=True)
    for refused in ("bpf", "kexec_load", "open_by_handle_at", "init_module", "keyctl",
                    "add_key", "request_key", "fsopen", "fsmount", "move_mount",
                    "open_tree", "mount_setattr", "io_uring_setup", "perf_event_open",
                    "userfaultfd", "setdomainname", "clone3"):
        assert refused not in names, refused
    assert lint.seccomp_text(profiles.render_seccomp(BUILD)) == []


def test_rootless_build_needs_no_capability_and_the_fuse_presets_stay_closed() -> None:
    assert profiles.PRESETS[BUILD].capabilities == ()
    for preset in FUSE_PRESETS:
        profile = json.loads(profiles.render_seccomp(preset))
        assert not passes(rules_for(profile, "clone"), CLONE_NEWUSER)
        assert rules_for(profile, "unshare") == []
        assert rules_for(profile, "keyctl") == []


def test_a_preset_without_the_build_additions_is_the_runtime_default() -> None:
    """The container test's control: the same preset without what it adds beyond the
    runtime default allows no new namespace at all."""
    bare = dataclasses.replace(profiles.PRESETS[BUILD], syscalls=(), new_namespaces=(),
                               enosys=())
    profile = seccomp.build(bare)
    assert allowed(profile) == set(seccomp.runtime_default_syscalls())
    assert not passes(rules_for(profile, "clone"), CLONE_NEWUSER)
    assert rules_for(profile, "unshare") == []


def test_rootless_build_apparmor_profile() -> None:
    text = profiles.render_apparmor(BUILD)
    rules = [lint.uncommented(line).strip() for line in text.splitlines()]
    # Neither an abi rule (a node without AppArmor has no /etc/apparmor.d/abi/ for the
    # installer's parser to read) nor a userns rule (AppArmor 3.0 cannot parse it).
    assert not [r for r in rules if r.startswith(("abi", "userns"))]
    assert "deny mount," not in rules
    mounts = [r for r in rules if r.startswith("mount ")]
    # Every mount rule names a filesystem type or options: no bare 'mount,'.
    assert all("fstype=" in r or "options=" in r for r in mounts)
    fuse = [r for r in mounts if "fstype=fuse" in r]
    assert fuse
    assert all("nosuid,nodev" in r for r in fuse)
    assert {r.split()[1] for r in fuse} == {"fstype=fuse.fuse-overlayfs", "fstype=fuse"}
    types = {r.split()[1].removeprefix("fstype=") for r in mounts if "fstype=" in r}
    assert types == {"fuse.fuse-overlayfs", "fuse", "overlay", "proc", "tmpfs", "devpts",
                     "mqueue"}
    assert "audit deny mount fstype=fuseblk," in rules
    # The build containers' runtime masks their /proc and /sys: no denial there.
    assert not [r for r in rules if "deny" in r and "mount" in r and "/proc" in r]
    # The runtime default's file rules stay.
    for kept in ("deny @{PROC}/kcore rwklx,", "deny /sys/kernel/security/** rwklx,",
                 "deny @{PROC}/sys/[^k]** w,"):
        assert kept in rules
    # Its pods unmask /proc (procMount: Unmasked): what the runtime's masks hide, AppArmor
    # refuses to read. Every masked path of the runtime is covered.
    assert "deny @{PROC}/{keys,latency_stats,timer_list,timer_stats,sched_debug} rwklx," \
        in rules
    assert "deny @{PROC}/{acpi,asound,scsi}/** rwklx," in rules
    covered = {f"/proc/{name}" for name in ("keys", "latency_stats", "timer_list",
                                            "timer_stats", "sched_debug", "acpi", "asound",
                                            "scsi", "kcore")}
    covered |= {"/sys/firmware", "/sys/devices/virtual/powercap"}
    assert set(oci.MASKED_PATHS) <= covered
    for preset in FUSE_PRESETS:
        assert "timer_list" not in profiles.render_apparmor(preset)
    assert lint.apparmor(text) == []
    with pytest.raises(profiles.ProfileError, match="takes no --mountpoint"):
        profiles.render_apparmor(BUILD, mountpoint="/storage")


@pytest.mark.parametrize("preset", PRESETS)
def test_apparmor_profile_shape(preset: str) -> None:
    text = profiles.render_apparmor(preset)
    name = profiles.apparmor_name(preset)
    assert f"profile {name} flags=(attach_disconnected,mediate_deleted) {{" in text
    assert apparmor.profile_name_of(text) == name
    rules = [line.split("#")[0].strip() for line in text.splitlines()]
    assert "deny mount," not in rules
    assert "audit deny mount fstype=fuseblk," in rules
    for kept in ("network,", "capability,", "file,", "deny @{PROC}/kcore rwklx,",
                 "deny /sys/kernel/security/** rwklx,", f"signal (send,receive) peer={name},"):
        assert kept in rules
    fuse_rules = [r for r in rules if r.startswith("mount fstype=fuse")]
    assert fuse_rules
    assert all("nosuid,nodev" in r for r in fuse_rules)
    types = {r.split()[1].removeprefix("fstype=") for r in fuse_rules}
    assert types == set(profiles.PRESETS[preset].fuse_fstypes)
    assert lint.apparmor(text) == []


def test_apparmor_mountpoint_and_name_narrow_the_rules() -> None:
    text = profiles.render_apparmor("sshfs", name="team-a-sshfs", mountpoint="/mnt/remote")
    assert "profile team-a-sshfs " in text
    assert "peer=team-a-sshfs," in text
    mounts = [line.strip() for line in text.splitlines() if line.strip().startswith("mount ")]
    assert mounts
    assert all(m.endswith("-> /mnt/remote{,/},") for m in mounts)
    assert "  umount /mnt/remote{,/},\n" in text
    assert "--name team-a-sshfs --mountpoint /mnt/remote" in text
    assert apparmor.mount_target("/mnt/**") == "/mnt/**"
    assert apparmor.mount_target("/mnt/") == "/mnt/"


def mount_rules(text: str) -> list[str]:
    rules = [line.split("#")[0].strip() for line in text.splitlines()]
    return [r for r in rules if r.split(" ", 1)[0] in ("mount", "audit", "umount", "remount")]


@pytest.mark.parametrize("preset", FUSE_PRESETS)
def test_fuse_presets_deny_every_mount_on_proc_sys_and_dev(preset: str) -> None:
    rules = mount_rules(profiles.render_apparmor(preset))
    assert rules[-3:] == ["audit deny mount fstype=fuseblk,",
                          "audit deny mount -> {/proc,/sys,/dev}{,/**},",
                          "audit deny umount {/proc,/sys,/dev}{,/**},"]
    assert not [r for r in rules if "/proc" in r and not r.startswith("audit deny")]


def test_lxcfs_binds_its_files_over_their_own_proc_names_only() -> None:
    rules = mount_rules(profiles.render_apparmor("lxcfs"))
    binds = [r for r in rules if r.startswith("mount") and "/proc" in r]
    assert binds == [f"mount options=(bind) /var/lib/lxcfs/proc/{name} -> /proc/{name},"
                     for name in presets.LXCFS_PROC_FILES]
    # A deny beats every allow: /proc is denied in parts, none of which matches those binds.
    assert rules[-6:] == [
        "audit deny mount fstype=fuseblk,",
        "audit deny mount -> {/sys,/dev}{,/**},",
        "audit deny mount -> /proc{,/,/*/**},",
        "audit deny mount fstype=?* -> /proc/*,",
        "audit deny mount options=(move) -> /proc/*,",
        "audit deny umount {/proc,/sys,/dev}{,/**},",
    ]
    narrowed = profiles.render_apparmor("lxcfs", mountpoint="/srv/lxcfs/")
    assert "mount options=(bind) /srv/lxcfs/proc/meminfo -> /proc/meminfo," in narrowed


def test_apparmor_lint_rejects_mount_options_apparmor_3_widens() -> None:
    text = profiles.render_apparmor("lxcfs")
    assert lint.apparmor(text) == []
    for rule in ("mount options=(rw,bind) / -> /run/lxcfs/root/,",
                 "mount options=(ro,bind) /a/ -> /b/,",
                 "mount options in (rw,move) /a/ -> /b/,",
                 "mount options=(nosuid,make-rprivate) -> /,"):
        widened = text.replace("  pivot_root", f"  {rule}\n  pivot_root")
        errors = lint.apparmor(widened)
        assert len(errors) == 1, (rule, errors)
        assert "also allowing a mount of any filesystem type" in errors[0], (rule, errors)
    for fine in ("mount options=(bind) /a/ -> /b/,", "mount options in (bind,rbind) /a/ -> /b/,",
                 "mount fstype=tmpfs options=(rw,nosuid) -> /b/,",
                 "mount options=(remount,ro) -> /b/,"):
        assert lint.apparmor(text.replace("  pivot_root", f"  {fine}\n  pivot_root")) == []


def test_apparmor_flag_combinations_are_small_and_documented() -> None:
    sets = apparmor.flag_sets()
    assert ("rw", "nosuid", "nodev") in sets
    assert ("ro", "nosuid", "nodev", "noatime") in sets
    assert len(sets) == len(set(sets)) == 8
    assert all({"nosuid", "nodev"} <= set(s) for s in sets)


def test_apparmor_lint_rejects_the_runtime_default_deny_mount() -> None:
    text = profiles.render_apparmor("s3fs").replace("  audit deny mount fstype=fuseblk,",
                                                     "  deny mount,")
    assert any("shadows the FUSE mount rules" in e for e in lint.apparmor(text))
    text = profiles.render_apparmor("generic").replace("fuseblk", "fuse.*")
    assert any("shadows" in e for e in lint.apparmor(text))
    text = profiles.render_apparmor("s3fs").replace("(rw,nosuid,nodev)", "(rw,nodev)")
    assert any("without nosuid" in e for e in lint.apparmor(text))
    complain = profiles.render_apparmor("s3fs").replace(
        "flags=(attach_disconnected", "flags=(complain,attach_disconnected")
    assert any("not in enforce mode" in e for e in lint.apparmor(complain))
    assert any("unbalanced" in e for e in lint.apparmor(profiles.render_apparmor("s3fs") + "}"))


# -- validation ---------------------------------------------------------------------------

BAD_NAMES = ["", "a b", "tab\there", "new\nline", "x'", 'x"', "x`", "x{y}", "x(y)", "x,y",
             "../etc/passwd", "a..b", "x/y", "-leading", "x" * 129, "unconfined", "tunables",
             "x#y", "x;y", "x\0y"]
BAD_GLOBS = ["", "relative/path", "/mnt/a b", "/mnt/'x'", "/mnt/{a,b}", "/mnt/[ab]",
             "/mnt/../etc", "/mnt/a,", "/mnt/#x", "/mnt/a\nb", "/mnt/@{HOME}", "/mnt/^x",
             "/" + "x" * 300, "/proc", "/proc/self/attr", "/sys/fs", "/dev/shm",
             "/mnt/x\\y", "/mnt/$x"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(profiles.ProfileError):
        profiles.render_apparmor("s3fs", name=name or "x y")
    with pytest.raises(validate.ProfileError):
        validate.profile_name(name)


@pytest.mark.parametrize("glob", BAD_GLOBS)
def test_bad_globs_are_refused(glob: str) -> None:
    with pytest.raises(validate.ProfileError):
        validate.mountpoint_glob(glob)


@pytest.mark.parametrize("glob", ["/mnt/data", "/mnt/*", "/home/*/s3/**", "/var/lib/lxcfs",
                                  "/mnt/s3-bucket_1.x", "/mnt/data/"])
def test_good_globs_pass(glob: str) -> None:
    assert validate.mountpoint_glob(glob) == glob
    assert lint.apparmor(profiles.render_apparmor("generic", mountpoint=glob)) == []


# -- write_all and the CLI ----------------------------------------------------------------

def test_write_all_builds_the_installer_layout(tmp_path: Path) -> None:
    written = profiles.write_all(tmp_path / "cm")
    names = sorted(p.name for p in written)
    assert names == sorted([f"fuse-device-plugin-{p}" for p in PRESETS]
                           + [f"{p}.json" for p in PRESETS])
    assert (tmp_path / "cm" / "s3fs.json").read_text() == profiles.render_seccomp("s3fs")
    assert profiles.seccomp_localhost_profile("s3fs") == "fuse-device-plugin/s3fs.json"
    assert not [p for p in (tmp_path / "cm").iterdir() if p.name.startswith(".")]


def test_cli_prints_and_writes_profiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    assert cli.main(["profile", "seccomp", "--preset", "sshfs"]) == 0
    assert capsys.readouterr().out == profiles.render_seccomp("sshfs")
    out = tmp_path / "s3fs.aa"
    out.write_text("old")
    assert cli.main(["profile", "apparmor", "--preset", "s3fs", "--mountpoint", "/mnt/s3",
                     "--output", str(out)]) == 0
    assert out.read_text() == profiles.render_apparmor("s3fs", mountpoint="/mnt/s3")
    assert capsys.readouterr().out == ""
    assert [p.name for p in tmp_path.iterdir()] == ["s3fs.aa"], "no temp file left behind"


@pytest.mark.parametrize("argv", [
    ["profile", "apparmor", "--preset", "s3fs", "--name", "evil,\n  capability sys_module"],
    ["profile", "apparmor", "--preset", "s3fs", "--name", "../../etc/shadow"],
    ["profile", "apparmor", "--preset", "s3fs", "--mountpoint", "/mnt/{a,b}"],
    ["profile", "apparmor", "--preset", "s3fs", "--mountpoint", "/proc/self"],
    ["profile", "apparmor", "--preset", "zfs"],
    ["profile", "seccomp", "--preset", "s3fs", "--mountpoint", "/mnt"],
    ["profile", "seccomp"],
    ["install-profiles"],
    ["install-profiles", "--source", "relative"],
])
def test_cli_usage_errors_are_one_line_exit_2(argv: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "error:" in err


@pytest.mark.parametrize("argv", [
    ["profile", "seccomp", "--preset", "s3fs", "--output", "/nonexistent-dir/x.json"],
    ["install-profiles", "--source", "/nonexistent-dir", "--once"],
])
def test_cli_bad_paths_are_one_line_exit_2(argv: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("fuse-device-plugin: error: ")


def test_cli_lint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good"
    good.write_text(profiles.render_apparmor("s3fs"))
    bad = tmp_path / "bad.json"
    bad.write_text(profiles.render_seccomp("s3fs").replace('"mount"', '"mnt"'))
    assert cli.main(["profile", "lint", str(good)]) == 0
    assert cli.main(["profile", "lint", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{good}: ok" in out
    assert "unknown system call 'mnt'" in out


@pytest.mark.parametrize("line", [
    "  /tmp/a# r, deny mount,",         # '#' inside a token is part of it, not a comment
    '  "/tmp/a #" r, deny mount,',       # nor inside quotes
    "  signal peer=a#b, deny mount,",
])
def test_apparmor_lint_sees_what_apparmor_parser_sees_past_a_hash(line: str) -> None:
    """apparmor_parser starts a comment at '#' only after a space, ',', a brace or a
    parenthesis (checked with apparmor_parser -d); elsewhere '#' is part of a path or
    name, and a lint that cut the line there would miss the rest of it."""
    text = profiles.render_apparmor("s3fs").replace("  file,\n", f"  file,\n{line}\n")
    assert any("shadows the FUSE mount rules" in e for e in lint.apparmor(text))


def test_apparmor_lint_skips_comments_after_a_brace_or_comma() -> None:
    text = profiles.render_apparmor("s3fs").replace("  file,\n", "  file,# deny mount,\n")
    text = text.replace("flags=(attach_disconnected,mediate_deleted) {",
                        "flags=(attach_disconnected,mediate_deleted) {# deny mount,")
    assert lint.apparmor(text) == []
