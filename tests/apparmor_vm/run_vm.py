#!/usr/bin/env python3
"""Boot Debian's AppArmor kernel under qemu (TCG) and run the profile tests; write the console log.

    run_vm.py [--log FILE] [--profile RUN=FILE]... [--timeout SECONDS]

Builds or reuses the cached guest (build-guest.sh), generates one AppArmor profile per preset
with `fuse-device-plugin profile apparmor`, adds the runtime-default control, packs them with
/init, the guest scripts and the mounttest probe into an initramfs overlay, boots, and waits for
qemu to exit. qemu exits 0 whatever happened in the guest: the console log is the result, and
tests/test_apparmor_vm.py judges it. Exit status: 0 when the guest ran to its end marker, 1 when
it did not, 77 when this machine cannot run it (not root, or no qemu).

--profile RUN=FILE loads FILE (its profile must be named as RUN's) for one run: the way to try a
rule change in the real kernel before changing the generator.
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
GUEST_FILES = ("guest-tests.sh", "confined.sh", "workloads.sh", "s3check.py", "broker.sh")


@dataclass(frozen=True)
class Run:
    """One confined run in the guest: a profile and the FUSE programs to mount under it."""

    name: str
    preset: str | None  # None: the runtime-default control, not a generated profile
    workloads: tuple[str, ...]  # must mount (under the control: must be refused)
    refused: tuple[str, ...] = ()  # real programs whose mount the profile must refuse
    mountpoint_glob: str | None = None  # --mountpoint for the generator
    subtype: str = "fuse.fdptest"  # the fuse.SUBTYPE of the raw FUSE probes
    # Where FUSE may be mounted when the preset itself narrows it (lxcfs: /var/lib/lxcfs).
    fixed_mountpoint: str | None = None

    @property
    def profile(self) -> str:
        return f"fdp-test-{self.name}"

    @property
    def base(self) -> str:
        return f"/mnt/fuse/{self.name}"

    @property
    def narrowed(self) -> bool:
        return self.mountpoint_glob is not None or self.fixed_mountpoint is not None

    def mountpoint(self, workload: str) -> str:
        if workload == "lxcfs":
            return LXCFS_MOUNTPOINT
        return self.fixed_mountpoint or f"{self.base}/{workload}"

    def plan_line(self) -> str:
        """The arguments guest-tests.sh hands to confined.sh under this run's profile."""
        fuse_target = self.fixed_mountpoint or f"{self.base}/raw"
        programs = [f"{w}={self.mountpoint(w)}" for w in self.workloads + self.refused]
        return " ".join([self.name, self.profile, self.base, fuse_target, self.subtype, *programs])


LXCFS_MOUNTPOINT = "/var/lib/lxcfs"  # where lxcfs mounts on every node, and the preset allows

RUNS = (
    Run("s3fs", "s3fs", ("s3fs",), subtype="fuse.s3fs"),
    Run("sshfs", "sshfs", ("sshfs",), subtype="fuse.sshfs"),
    # fuse-overlayfs asks for suid (its mount flags lack nosuid): no FUSE profile may grant that;
    # with -o nosuid it mounts nosuid,nodev,noatime, which the generic preset allows.
    Run(
        "generic",
        "generic",
        ("bindfs", "sshfs", "s3fs", "fuse-overlayfs-nosuid"),
        ("fuse-overlayfs",),
    ),
    Run("lxcfs", "lxcfs", ("lxcfs",), subtype="fuse.lxcfs", fixed_mountpoint=LXCFS_MOUNTPOINT),
    # A generated profile narrowed to a mountpoint glob: FUSE under it, nowhere else.
    Run("narrowed", "generic", ("bindfs",), mountpoint_glob="/mnt/fuse/narrowed/**"),
    Run("control", None, ("s3fs", "sshfs", "bindfs", "lxcfs")),
)


def why_not_runnable() -> str | None:
    """Why this machine cannot run the VM at all (the tests skip then); None when it can."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, device nodes in the guest root)"
    if shutil.which(QEMU) is None:
        return f"{QEMU} is not installed (Debian qemu-system-x86; scripts/install --dev)"
    return None


def missing_tools() -> list[str]:
    """Tools the build needs beyond qemu: missing ones are an install error, not a skip."""
    return [
        t
        for t in ("debootstrap", "cpio", "gcc", "musl-gcc", "dpkg-deb", "ssh-keygen")
        if not shutil.which(t)
    ]


def control_profile(name: str) -> str:
    return CONTROL_TEMPLATE.read_text().replace("@NAME@", name)


def generated_profile(run: Run, out: Path) -> None:
    assert run.preset is not None
    venv_python = REPO / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    cmd = [python, "-m", "fuse_plugin", "profile", "apparmor", "--preset", run.preset]
    cmd += ["--name", run.profile, "--output", str(out)]
    if run.mountpoint_glob:
        cmd += ["--mountpoint", run.mountpoint_glob]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run_vm: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


def write_overlay(stage: Path, overrides: dict[str, Path]) -> None:
    fdp = stage / "fdp"
    (fdp / "profiles").mkdir(parents=True)
    shutil.copy2(HERE / "init", stage / "init")
    for name in GUEST_FILES:
        shutil.copy2(HERE / name, fdp / name)
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-static", "-o", str(fdp / "mounttest"), str(HERE / "mounttest.c")],
        check=True,
    )
    # Broker mode (broker.sh): the package (the broker is stdlib Python), the shim and
    # fuse-broker-helper as the image builds them, and a seccomp filter like the runtime's.
    shutil.copytree(REPO / "fuse_plugin", fdp / "py" / "fuse_plugin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([str(REPO / "scripts" / "build-native"), str(fdp / "native")], check=True)
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-static", "-o", str(fdp / "seccomp-eperm"),
         str(HERE / "seccomp-eperm.c")],
        check=True,
    )
    plan = []
    for run in RUNS:
        out = fdp / "profiles" / run.profile
        if run.name in overrides:
            shutil.copyfile(overrides[run.name], out)
        elif run.preset is None:
            out.write_text(control_profile(run.profile))
        else:
            generated_profile(run, out)
        plan.append(run.plan_line() + "\n")
    (fdp / "plan").write_text("".join(plan))


def pack_initrd(base_cpio: Path, stage: Path, dest: Path) -> None:
    """The cached root followed by this run's files: the kernel unpacks both archives in order."""
    names = subprocess.run(
        "find . -mindepth 1 -print0 | LC_ALL=C sort -z",
        shell=True,
        cwd=stage,
        check=True,
        capture_output=True,
    ).stdout
    with dest.open("wb") as out:
        with base_cpio.open("rb") as base:
            shutil.copyfileobj(base, out, 1 << 20)
        subprocess.run(
            ["cpio", "--null", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
            cwd=stage,
            input=names,
            stdout=out,
            check=True,
        )


def boot(guest: Path, initrd: Path, log: Path, timeout: float) -> int:
    cmdline = (
        "console=ttyS0 rdinit=/init apparmor=1 security=apparmor panic=-1 loglevel=4 "
        "log_buf_len=4M random.trust_cpu=on"
    )
    cmd = [
        QEMU,
        "-accel",
        "tcg",
        "-cpu",
        "max",
        "-smp",
        "2",
        "-m",
        "3072",
        "-display",
        "none",
        "-monitor",
        "none",
        "-nic",
        "none",
        "-no-reboot",
        "-serial",
        f"file:{log}",
        "-kernel",
        str(guest / "vmlinuz"),
        "-initrd",
        str(initrd),
        "-append",
        cmdline,
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
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--profile", action="append", default=[], metavar="RUN=FILE")
    args = ap.parse_args()
    runs = {run.name for run in RUNS}
    overrides = {}
    for item in args.profile:
        name, _, file = item.partition("=")
        if name not in runs or not Path(file).is_file():
            ap.error(f"--profile {item}: RUN is one of {sorted(runs)}, FILE an existing file")
        overrides[name] = Path(file)

    reason = why_not_runnable()
    if reason:
        print(f"run_vm: skipped: {reason}", file=sys.stderr)
        return 77
    missing = missing_tools()
    if missing:
        print(f"run_vm: missing {', '.join(missing)}: run scripts/install --dev", file=sys.stderr)
        return 1

    t0 = time.monotonic()
    build = subprocess.run(
        ["bash", str(HERE / "build-guest.sh")],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},  # its pip fetches moto for the guest
    )
    if build.returncode != 0:
        print(f"run_vm: build-guest.sh failed ({build.returncode})", file=sys.stderr)
        return 1
    guest = Path(build.stdout.split()[-1])
    t_build = time.monotonic() - t0
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fdp-vm-") as tmp:
        stage = Path(tmp) / "stage"
        write_overlay(stage, overrides)
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
