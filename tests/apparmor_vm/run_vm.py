#!/usr/bin/env python3
"""Boot Debian's AppArmor kernel under qemu (TCG) and run the profile tests; write the console log.

    run_vm.py [--log FILE] [--handwritten] [--timeout SECONDS]

Builds or reuses the cached guest (build-guest.sh), generates one AppArmor profile per preset
with `fuse-device-plugin profile apparmor`, adds the runtime-default control, packs them with
/init, the guest scripts and the mounttest probe into an initramfs overlay, boots, and waits for
qemu to exit. qemu exits 0 whatever happened in the guest: the console log is the result, and
tests/test_apparmor_vm.py judges it. Exit status: 0 when the guest ran to its end marker, 1 when
it did not, 77 when this machine cannot run it (not root, no qemu, no gcc).

--handwritten uses a hand-written FUSE-only profile for every preset instead of the generator's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
QEMU = "qemu-system-x86_64"
END_MARKER = "FDPT done"
CONTROL_TEMPLATE = HERE / "profiles" / "runtime-default.apparmor.in"
GUEST_FILES = ("guest-tests.sh", "confined.sh", "workloads.sh", "s3check.py")


@dataclass(frozen=True)
class Run:
    """One confined run in the guest: a profile and the FUSE programs to mount under it."""

    name: str
    profile: str
    preset: str | None  # None: the runtime-default control, not a generated profile
    workloads: tuple[str, ...]  # must mount (under the control: must be refused)
    refused: tuple[str, ...] = ()  # real programs whose mount the profile must refuse
    mountpoint_glob: str | None = None

    @property
    def base(self) -> str:
        return f"/mnt/fuse/{self.name}"


RUNS = (
    Run("s3fs", "fdp-test-s3fs", "s3fs", ("s3fs",)),
    Run("sshfs", "fdp-test-sshfs", "sshfs", ("sshfs",)),
    # fuse-overlayfs asks for suid (its mount flags lack nosuid): no FUSE profile may grant that.
    Run("generic", "fdp-test-generic", "generic", ("bindfs", "sshfs", "s3fs"), ("fuse-overlayfs",)),
    Run("lxcfs", "fdp-test-lxcfs", "lxcfs", ("lxcfs",)),
    # A generated profile narrowed to a mountpoint glob: FUSE under it, nowhere else.
    Run("narrowed", "fdp-test-narrowed", "generic", ("bindfs",),
        mountpoint_glob="/mnt/fuse/narrowed/**"),
    Run("control", "fdp-test-control", None, ("s3fs", "sshfs", "bindfs", "lxcfs")),
)


def why_not_runnable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (debootstrap, cpio device nodes)"
    for tool in (QEMU, "debootstrap", "cpio", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/apt-packages.txt lists it)"
    return None


def control_profile(name: str) -> str:
    return CONTROL_TEMPLATE.read_text().replace("@NAME@", name)


def handwritten_profile(name: str, glob: str | None) -> str:
    target = f" -> {glob}" if glob else ""
    rules = "\n".join(
        [
            f"  mount fstype=fuse options=(rw,nosuid,nodev){target},",
            f"  mount fstype=fuse.* options=(rw,nosuid,nodev){target},",
            "  audit deny mount fstype=fuseblk,",
        ]
    )
    return control_profile(name).replace("  deny mount,", rules)


def generated_profile(run: Run, out: Path) -> None:
    assert run.preset is not None
    cmd = [sys.executable, "-m", "fuse_plugin", "profile", "apparmor", "--preset", run.preset]
    cmd += ["--name", run.profile, "--output", str(out)]
    if run.mountpoint_glob:
        cmd += ["--mountpoint", run.mountpoint_glob]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run_vm: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


def write_overlay(stage: Path, handwritten: bool) -> None:
    fdp = stage / "fdp"
    (fdp / "profiles").mkdir(parents=True)
    shutil.copy2(HERE / "init", stage / "init")
    for name in GUEST_FILES:
        shutil.copy2(HERE / name, fdp / name)
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-static", "-o", str(fdp / "mounttest"), str(HERE / "mounttest.c")],
        check=True,
    )
    plan = []
    for run in RUNS:
        out = fdp / "profiles" / run.profile
        if run.preset is None:
            out.write_text(control_profile(run.profile))
        elif handwritten:
            out.write_text(handwritten_profile(run.profile, run.mountpoint_glob))
        else:
            generated_profile(run, out)
        plan.append(f"{run.name} {run.profile} {run.base} {' '.join(run.workloads + run.refused)}\n")
    (fdp / "plan").write_text("".join(plan))


def pack_initrd(base_cpio: Path, stage: Path, dest: Path) -> None:
    """The cached root followed by this run's files: the kernel unpacks both archives in order."""
    names = subprocess.run(
        "find . -mindepth 1 -print0 | LC_ALL=C sort -z",
        shell=True, cwd=stage, check=True, capture_output=True,
    ).stdout
    with dest.open("wb") as out:
        with base_cpio.open("rb") as base:
            shutil.copyfileobj(base, out, 1 << 20)
        subprocess.run(
            ["cpio", "--null", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
            cwd=stage, input=names, stdout=out, check=True,
        )


def boot(guest: Path, initrd: Path, log: Path, timeout: float) -> int:
    cmdline = (
        "console=ttyS0 rdinit=/init apparmor=1 security=apparmor panic=-1 loglevel=4 "
        "log_buf_len=4M random.trust_cpu=on"
    )
    cmd = [
        QEMU, "-accel", "tcg", "-cpu", "max", "-smp", "2", "-m", "3072",
        "-display", "none", "-monitor", "none", "-nic", "none", "-no-reboot",
        "-serial", f"file:{log}",
        "-kernel", str(guest / "vmlinuz"), "-initrd", str(initrd), "-append", cmdline,
    ]
    try:
        return subprocess.run(cmd, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        with log.open("a") as f:
            f.write(f"\nrun_vm: qemu did not exit within {timeout:.0f}s and was killed\n")
        return -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--log", type=Path, default=REPO / "build" / "apparmor-vm" / "console.log")
    ap.add_argument("--handwritten", action="store_true")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()

    reason = why_not_runnable()
    if reason:
        print(f"run_vm: skipped: {reason}", file=sys.stderr)
        return 77

    t0 = time.monotonic()
    guest = Path(
        subprocess.run(
            ["bash", str(HERE / "build-guest.sh")], check=True, capture_output=False,
            stdout=subprocess.PIPE, text=True,
        ).stdout.strip().splitlines()[-1]
    )
    t_build = time.monotonic() - t0
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fdp-vm-", dir=guest.parent) as tmp:
        stage = Path(tmp) / "stage"
        write_overlay(stage, args.handwritten)
        initrd = Path(tmp) / "initrd.cpio"
        pack_initrd(guest / "rootfs.cpio", stage, initrd)
        args.log.unlink(missing_ok=True)
        t1 = time.monotonic()
        rc = boot(guest, initrd, args.log, args.timeout)
        t_boot = time.monotonic() - t1
    text = args.log.read_text(errors="replace") if args.log.exists() else ""
    ok = END_MARKER in text
    print(
        f"run_vm: guest {guest.name}: build/cache {t_build:.1f}s, boot+tests {t_boot:.1f}s, "
        f"qemu exit {rc}, {'complete' if ok else 'INCOMPLETE'}; log {args.log}",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
