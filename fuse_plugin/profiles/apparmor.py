"""AppArmor profiles: the runtime's default confinement with FUSE mounts let through.

The rules follow the container runtime's default profile (containerd's
``cri-containerd.apparmor.d``, Docker's ``docker-default``) rule for rule: all network,
capability and file access, signals and ptrace only among the container's own processes,
no writes to /proc outside the process's own entries and /proc/sys/kernel/shm*, no
writes under /sys except the cgroup tree, nothing at all in /sys/firmware, powercap or
/sys/kernel/security. The one change: the default's ``deny mount,`` is gone (a deny rule
beats every allow rule, so no FUSE rule could work beside it) and in its place come
mount rules for the preset's FUSE types only, with nosuid,nodev, optionally narrowed to
a mountpoint glob, plus explicit denials for fuseblk and for anything mounted on or
unmounted from /proc, /sys and /dev. One exception, lxcfs's: binds of the files it
serves over the same names in /proc (``Preset.proc_binds``). And one preset that is not
FUSE, rootless-build (``Preset.nested_containers``): the mounts a rootless build makes in
user namespaces of its own, by filesystem type, and no denials on /proc, /sys and /dev.

The profile is self-contained (it defines ``@{PROC}`` itself and includes nothing), so
``apparmor_parser`` checks and loads it the same on every node, whatever abstractions
the node's /etc/apparmor.d carries; the runtime default pulls in ``abstractions/base``
only for file access that ``file,`` already grants.
"""

from __future__ import annotations

from itertools import combinations

from fuse_plugin import __version__
from fuse_plugin.profiles import presets, validate

# (rule, why) pairs: the runtime default's denials, with our own explanations.
PROC_DENIALS = (
    ("deny @{PROC}/* w,", "no writes to files directly in /proc"),
    ("deny @{PROC}/{[^1-9],[^1-9][^0-9],[^1-9s][^0-9y][^0-9s],[^1-9][^0-9][^0-9][^0-9]*}/** w,",
     "nor below it, except in /proc/<pid>/ and /proc/sys/"),
    ("deny @{PROC}/sys/[^k]** w,", "in /proc/sys only /proc/sys/kernel/..."),
    ("deny @{PROC}/sys/kernel/{?,??,[^s][^h][^m]**} w,", "...and there only shm*"),
    ("deny @{PROC}/sysrq-trigger rwklx,", "the host's magic SysRq key"),
    ("deny @{PROC}/kcore rwklx,", "the host's physical memory"),
)
SYS_DENIALS = (
    ("deny /sys/[^f]*/** wklx,", "no writes under /sys except the cgroup tree"),
    ("deny /sys/f[^s]*/** wklx,", ""),
    ("deny /sys/fs/[^c]*/** wklx,", ""),
    ("deny /sys/fs/c[^g]*/** wklx,", ""),
    ("deny /sys/fs/cg[^r]*/** wklx,", ""),
    ("deny /sys/firmware/** rwklx,", "firmware tables: not even reads"),
    ("deny /sys/devices/virtual/powercap/** rwklx,", "energy counters (side channel)"),
    ("deny /sys/kernel/security/** rwklx,", "the LSM interfaces, this policy included"),
)
# What the runtime's masked paths hide (containerd's defaults, /dev/null or a read-only
# tmpfs over each), for pods whose /proc is unmasked (procMount: Unmasked, which the
# rootless-build preset's pods need): AppArmor refuses reading them instead.
# /proc/kcore, /sys/firmware and powercap are refused in full above.
MASKED_READ_DENIALS = (
    ("deny @{PROC}/{keys,latency_stats,timer_list,timer_stats,sched_debug} rwklx,",
     "what the runtime's masks hide, for a pod with procMount: Unmasked"),
    ("deny @{PROC}/{acpi,asound,scsi}/** rwklx,", ""),
)
PROTECTED = "{" + ",".join(validate.PROTECTED_TREES) + "}{,/**}"
# The same without /proc, for profiles that bind files over /proc (see proc_mount_denials).
PROTECTED_BUT_PROC = "{" + ",".join(
    tree for tree in validate.PROTECTED_TREES if tree != "/proc") + "}{,/**}"


def mount_target(glob: str) -> str:
    """The mountpoint as AppArmor sees it: directories are matched with a trailing '/'."""
    if glob.endswith(("/", "**")):
        return glob
    return glob + "{,/}"


def flag_sets() -> list[tuple[str, ...]]:
    """Every allowed FUSE flag combination: rw or ro, nosuid,nodev, then optional extras."""
    extras = [flag for flag in presets.FUSE_OPTIONAL_FLAGS if flag != "ro"]
    sets = []
    for readonly in (False, True):
        for count in range(len(extras) + 1):
            for chosen in combinations(extras, count):
                sets.append(("ro" if readonly else "rw", *presets.FUSE_REQUIRED_FLAGS, *chosen))
    return sets


def fuse_rules(fstypes: tuple[str, ...], target: str) -> list[str]:
    return [
        f"mount fstype={fstype} options=({','.join(flags)}) -> {target},"
        for fstype in fstypes for flags in flag_sets()
    ]


def proc_bind_rules(files: tuple[str, ...], glob: str) -> list[str]:
    """Binds of ``<mountpoint>/proc/NAME`` over ``/proc/NAME``, one rule per file.

    One rule each, not one with alternations, so a file can only go over its own name.
    ``options=(bind)`` and not ``(rw,bind)``: the kernel checks a bind's flags after
    dropping all but bind and rec, so both allow the same binds, but AppArmor 3.0's parser
    makes ``rw,bind`` also allow any mount without flags from that source to that target.
    """
    root = glob.rstrip("/")
    return [f"mount options=(bind) {root}/proc/{name} -> /proc/{name}," for name in files]


def proc_mount_denials() -> list[str]:
    """The mount denials on /proc, /sys and /dev for a profile that binds files over /proc.

    A deny rule beats every allow rule and AppArmor has no "except" for a deny, so the
    usual one rule for all three trees would refuse those binds. /proc is denied in parts
    that leave them out instead: /proc itself, each directory in it (a directory's path
    ends in '/') and everything below those, in full; on the files directly in /proc, every
    new mount (a bind names no filesystem type, every other mount does) and every move.
    What is left there - a bind, a remount, a propagation change - is refused because no
    rule allows it (AppArmor logs that with a DENIED line too), except the binds above; a
    remount or propagation change needs a mount rooted at the file, so can only touch those.
    """
    return [
        "  # ...except the binds over /proc above: a deny beats every allow, so /proc is",
        "  # denied in parts that leave them out. Nothing on /proc, its directories or",
        "  # below them; on its files no new mount and no move (binds, remounts and",
        "  # propagation changes there are refused unless allowed above, logged alike).",
        f"  audit deny mount -> {PROTECTED_BUT_PROC},",
        "  audit deny mount -> /proc{,/,/*/**},",
        "  audit deny mount fstype=?* -> /proc/*,",
        "  audit deny mount options=(move) -> /proc/*,",
    ]


def render(preset_name: str, name: str | None = None, mountpoint: str | None = None) -> str:
    """The profile text. ``name`` and ``mountpoint`` are validated (ProfileError)."""
    preset = presets.get(preset_name)
    if mountpoint and preset.nested_containers:
        raise validate.ProfileError(
            f"preset {preset_name} takes no --mountpoint: its build mounts wherever its "
            "storage and its containers' roots are")
    name = validate.profile_name(name or presets.apparmor_name(preset_name))
    glob = validate.mountpoint_glob(mountpoint) if mountpoint else preset.default_mountpoint
    command = f"fuse-device-plugin profile apparmor --preset {preset_name}"
    if name != presets.apparmor_name(preset_name):
        command += f" --name {name}"
    if mountpoint:
        command += f" --mountpoint {mountpoint}"
    lines = _header(preset, name, command)
    lines += [
        "@{PROC}=/proc/",
        "",
        f"profile {name} flags=(attach_disconnected,mediate_deleted) {{",
        "  # As the runtime default: the container's own network, capabilities and files.",
        "  network,",
        "  capability,",
        "  file,",
        "",
        "  # Signals from the host (unconfined) and among the container's own processes.",
        "  signal (receive) peer=unconfined,",
        f"  signal (send,receive) peer={name},",
        f"  ptrace (trace,read,tracedby,readby) peer={name},",
        "",
    ]
    lines += _commented(PROC_DENIALS)
    if preset.nested_containers:
        lines += _commented(MASKED_READ_DENIALS)
    lines.append("")
    lines += _commented(SYS_DENIALS)
    lines += _mount_rules(preset, glob)
    lines += _mount_denials(preset)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _header(preset: presets.Preset, name: str, command: str) -> list[str]:
    lines = [
        f"# AppArmor profile {name}: preset {preset.name} ({preset.summary}).",
        f"# Generated by fuse-device-plugin {__version__}; regenerate, do not edit:",
        f"#   {command}",
    ]
    if preset.nested_containers:
        lines += [
            "# The container runtime's default confinement, except for the mounts below: the",
            "# ones a rootless build makes in mount namespaces of its own user namespaces.",
            "# For pods with hostUsers: false only, adding no capabilities (or SETUID and",
            "# SETGID for newuidmap and newgidmap: builds with more than one uid). No user",
            "# namespace rule: compiled by AppArmor 3.0 (the installer's) it does not",
            "# mediate user namespaces at all (docs/profiles.md, rootless-build).",
            "",
        ]
    else:
        lines += [
            "# The container runtime's default confinement, except that the FUSE mounts below",
            "# are allowed; every other mount stays denied.",
            "",
        ]
    return lines


def _mount_rules(preset: presets.Preset, glob: str) -> list[str]:
    """What replaces the runtime default's ``deny mount,``: the FUSE rules, then the
    preset's others."""
    target = mount_target(glob)
    if preset.nested_containers:
        lines = [
            "",
            "  # Instead of the runtime default's 'deny mount,'. fuse-overlayfs, where the",
            "  # kernel refuses overlay in a user namespace: never set-uid or device files.",
        ]
    else:
        lines = [
            "",
            "  # Replaces the runtime default's 'deny mount,': FUSE only, never set-uid or",
            f"  # device files, only at {glob}.",
        ]
    lines += [f"  {rule}" for rule in fuse_rules(preset.fuse_fstypes, target)]
    lines.append(f"  umount {target},")
    if preset.extra_apparmor:
        if preset.nested_containers:
            lines += ["", "  # The build's own mounts, by filesystem type (docs/profiles.md):"]
        else:
            lines += ["", f"  # {preset.name} needs more than FUSE mounts (see the preset's "
                          "docs):"]
        lines += [f"  {rule}" for rule in preset.extra_apparmor]
        lines += [f"  umount {path}," for path in preset.extra_umounts]
    if preset.proc_binds:
        lines += ["", f"  # Its files bound over their own names in /proc, from below {glob}:"]
        lines += [f"  {rule}" for rule in proc_bind_rules(preset.proc_binds, glob)]
    return lines


def _mount_denials(preset: presets.Preset) -> list[str]:
    if preset.nested_containers:
        return [
            "",
            "  # Block devices stay out of reach. Mounts on /proc, /sys and /dev are not",
            "  # denied: each build container's runtime masks its own /proc and /sys there",
            "  # after pivot_root. The pod's own mounts are the kernel's to guard: mounting",
            "  # needs CAP_SYS_ADMIN over the mount namespace, which the pod does not hold,",
            "  # and a user namespace of its own cannot undo the mounts it was given.",
            "  audit deny mount fstype=fuseblk,",
        ]
    lines = [
        "",
        "  # Block devices stay out of reach, and nothing is mounted on or unmounted",
        "  # from /proc, /sys or /dev: the runtime writes there on exec and masks them.",
        "  # 'audit' makes each refusal leave an apparmor=\"DENIED\" line (plain deny is",
        "  # silent), so the node's log says which rule stopped a mount.",
        "  audit deny mount fstype=fuseblk,",
    ]
    if preset.proc_binds:
        lines += proc_mount_denials()
    else:
        lines.append(f"  audit deny mount -> {PROTECTED},")
    lines.append(f"  audit deny umount {PROTECTED},")
    return lines


def _commented(rules: tuple[tuple[str, str], ...]) -> list[str]:
    lines = []
    for rule, why in rules:
        if why:
            lines.append(f"  # {why}")
        lines.append(f"  {rule}")
    return lines


def profile_name_of(text: str) -> str | None:
    """The name in the first ``profile NAME`` line of a profile, if any."""
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "profile":
            return words[1]
    return None
