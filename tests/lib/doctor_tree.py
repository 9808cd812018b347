"""A fake node's file tree for ``doctor``: what a healthy node has under ``/`` (the
device node and the sockets apart), which tests then break one part at a time."""

from __future__ import annotations

import json
from pathlib import Path

from fuse_plugin.doctor import checks as doctor

PLUGIN_DIR = "var/lib/kubelet/device-plugins"
SOCKET = "github.com_fuse.sock"
SECCOMP_DIR = "var/lib/kubelet/seccomp/fuse-device-plugin"
SECCOMP_OK = {"defaultAction": "SCMP_ACT_ERRNO", "architectures": ["SCMP_ARCH_X86_64"],
              "syscalls": [{"names": ["read", "mount", "umount2"], "action": "SCMP_ACT_ALLOW"}]}


def put(root: Path, path: str, text: str) -> Path:
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def apparmor_listing(*profiles: str) -> str:
    return "".join(f"{profile}\n" for profile in
                   ["cri-containerd.apparmor.d (enforce)", *profiles, "/usr/bin/man (enforce)"])


def build_static_tree(root: Path) -> None:
    """Everything of a healthy node but the device node and the sockets."""
    put(root, "proc/filesystems", "nodev\tsysfs\nnodev\tfusectl\n\text4\n\tfuseblk\nnodev\tfuse\n")
    (root / PLUGIN_DIR).mkdir(parents=True)
    put(root, "sys/module/apparmor/parameters/enabled", "Y\n")
    put(root, "sys/kernel/security/apparmor/profiles", apparmor_listing(
        *(f"fuse-device-plugin-{preset} (enforce)" for preset in doctor.PRESETS)))
    for preset in doctor.PRESETS:
        put(root, f"{SECCOMP_DIR}/{preset}.json", json.dumps(SECCOMP_OK))
    put(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
