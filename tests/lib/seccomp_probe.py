"""Load an OCI seccomp profile into libseccomp the way runc does, export its BPF, apply it to
this process, and report what a few system calls return under it (JSON on stdout).

Run as its own process (the filter cannot be taken off again):
    python seccomp_probe.py PROFILE.json BPF_OUT [--errno N]

``--errno N`` makes refusals by the default action return N instead of the profile's own
errno, so a refusal by seccomp cannot be mistaken for the same errno from the kernel.
Each probe's arguments are chosen so that, if seccomp lets the call through, the kernel
fails it harmlessly (EFAULT, EBADF, EINVAL) or it does nothing (unshare(0)).
"""

from __future__ import annotations

import ctypes
import errno
import json
import sys
from typing import Any

import pyseccomp

ACTIONS = {"SCMP_ACT_ALLOW": pyseccomp.ALLOW, "SCMP_ACT_KILL": pyseccomp.KILL,
           "SCMP_ACT_KILL_PROCESS": pyseccomp.KILL_PROCESS, "SCMP_ACT_LOG": pyseccomp.LOG,
           "SCMP_ACT_TRAP": pyseccomp.TRAP}
OPS = {"SCMP_CMP_NE": pyseccomp.NE, "SCMP_CMP_LT": pyseccomp.LT, "SCMP_CMP_LE": pyseccomp.LE,
       "SCMP_CMP_EQ": pyseccomp.EQ, "SCMP_CMP_GE": pyseccomp.GE, "SCMP_CMP_GT": pyseccomp.GT,
       "SCMP_CMP_MASKED_EQ": pyseccomp.MASKED_EQ}
CLONE_NEWNS, CLONE_FS, CLONE_THREAD = 0x00020000, 0x00000200, 0x00010000
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x40000000, 0x02000000
CLONE_NEWTIME = 0x00000080
# Not an unshare() flag: the kernel refuses the call (EINVAL) once seccomp lets it through,
# so these probes never leave the probe in a new namespace.
UNSHARE_BAD = 0x00000001
READ_IMPLIES_EXEC = 0x0400000

# probe name -> (system call, arguments)
PROBES: dict[str, tuple[str, tuple[int, ...]]] = {
    "getpid": ("getpid", ()),
    "mount": ("mount", (0, 0, 0, 0, 0)),                    # NULL target: EFAULT
    "umount2": ("umount2", (0, 0)),                         # NULL target: EFAULT
    "unshare": ("unshare", (0,)),                           # no flags: a no-op
    "setns": ("setns", (-1, 0)),                            # EBADF
    "pivot_root": ("pivot_root", (0, 0)),                   # EFAULT
    "chroot": ("chroot", (0,)),                             # EFAULT
    "clone_plain": ("clone", (CLONE_THREAD, 0, 0, 0, 0)),   # no SIGHAND: EINVAL
    "clone_newns": ("clone", (CLONE_NEWNS | CLONE_FS, 0, 0, 0, 0)),  # NEWNS+FS: EINVAL
    "clone3": ("clone3", (0, 0)),                           # size 0: EINVAL
    "personality_query": ("personality", (0xFFFFFFFF,)),
    "personality_exec": ("personality", (READ_IMPLIES_EXEC,)),
    "kexec_load": ("kexec_load", (0, 0, 0, 0xFFFFFFFF)),   # bad flags: EINVAL
    "open_by_handle_at": ("open_by_handle_at", (-1, 0, 0)),
    "bpf": ("bpf", (-1, 0, 0)),                              # bad command: EINVAL
    "reboot": ("reboot", (0, 0, 0, 0)),                      # bad magic: EINVAL
    "init_module": ("init_module", (0, 0, 0)),
    "ptrace": ("ptrace", (-1, 0, 0, 0)),                     # bad request: EIO/ESRCH
    # THREAD without SIGHAND: EINVAL once through the filter.
    "clone_newuser": ("clone", (CLONE_NEWUSER | CLONE_THREAD, 0, 0, 0, 0)),
    "clone_newnet": ("clone", (CLONE_NEWNET | CLONE_THREAD, 0, 0, 0, 0)),
    "clone_newcgroup": ("clone", (CLONE_NEWCGROUP | CLONE_THREAD, 0, 0, 0, 0)),
    "unshare_newuser_newns": ("unshare", (CLONE_NEWUSER | CLONE_NEWNS | UNSHARE_BAD,)),
    "unshare_newnet": ("unshare", (CLONE_NEWNET | UNSHARE_BAD,)),
    "unshare_newcgroup": ("unshare", (CLONE_NEWCGROUP | UNSHARE_BAD,)),
    "unshare_newtime": ("unshare", (CLONE_NEWTIME | UNSHARE_BAD,)),
    "sethostname": ("sethostname", (0, 1000)),               # longer than 64: EINVAL
    "keyctl": ("keyctl", (0x7FFFFFFF, 0, 0, 0, 0)),          # no such operation
    "fsopen": ("fsopen", (0, 0)),                            # NULL name: EFAULT
    "io_uring_setup": ("io_uring_setup", (0, 0)),            # no entries: EINVAL/EFAULT
}


def build_filter(profile: dict[str, Any], errno_override: int | None
                 ) -> tuple[pyseccomp.SyscallFilter, list[str]]:
    default = profile["defaultAction"]
    if default != "SCMP_ACT_ERRNO":
        raise SystemExit(f"probe handles SCMP_ACT_ERRNO defaults only, not {default}")
    default_errno = errno_override or profile.get("defaultErrnoRet") or errno.EPERM
    flt = pyseccomp.SyscallFilter(pyseccomp.ERRNO(default_errno))
    native = pyseccomp.system_arch()
    for arch_name in profile.get("architectures", []):
        arch = getattr(pyseccomp.Arch, arch_name.removeprefix("SCMP_ARCH_"))
        if arch != native:
            flt.add_arch(arch)
    skipped = []
    for entry in profile["syscalls"]:
        if entry["action"] == "SCMP_ACT_ERRNO":
            action = pyseccomp.ERRNO(entry.get("errnoRet", errno.EPERM))
        else:
            action = ACTIONS[entry["action"]]
        args = [pyseccomp.Arg(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
                for a in entry.get("args") or []]
        for name in entry["names"]:
            number = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
            if number == -1:  # __NR_SCMP_ERROR: runc skips such a name silently
                skipped.append(name)
                continue
            flt.add_rule(action, number, *args)
    return flt, skipped


def main() -> int:
    profile_path, bpf_path = sys.argv[1], sys.argv[2]
    errno_override = int(sys.argv[4]) if sys.argv[3:4] == ["--errno"] else None
    with open(profile_path) as f:
        profile = json.load(f)
    flt, skipped = build_filter(profile, errno_override)
    with open(bpf_path, "wb") as out:
        flt.export_bpf(out)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    numbers = {probe: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, call)
               for probe, (call, _) in PROBES.items()}
    results: dict[str, int] = {}
    flt.load()
    for probe, (_, args) in PROBES.items():
        ctypes.set_errno(0)
        ret = libc.syscall(ctypes.c_long(numbers[probe]), *(ctypes.c_long(a) for a in args))
        results[probe] = ctypes.get_errno() if ret == -1 else 0
    sys.stdout.write(json.dumps({"skipped": skipped, "results": results}) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
