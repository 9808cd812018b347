#!/usr/bin/env python3
"""Make a single-layer OCI image tarball from host files (no registry needed).

    mkimage.py --name fdp-e2e/pause --out pause.tar --entrypoint /pause \
        --file /path/on/host/pause:/pause
    mkimage.py --name fdp-e2e/workload --out workload.tar --entrypoint /bin/sh \
        --binary /usr/bin/sshfs --busybox /bin/busybox \
        --text /etc/passwd:'root:x:0:0::/root:/bin/sh'

--binary copies the executable to the same path and every shared library that
`ldd` reports, plus the ELF interpreter.  The layer is uncompressed and written
with fixed owners and mtimes, so the same inputs give the same digest; the tag
is derived from that digest and printed (``name:tag``) on stdout.  The archive
carries ``io.containerd.image.name`` so ``ctr images import`` names it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

# busybox applets the e2e pods use
BUSYBOX_APPLETS = [
    "sh",
    "ls",
    "cat",
    "echo",
    "mkdir",
    "sleep",
    "grep",
    "mount",
    "umount",
    "stat",
    "test",
    "true",
    "false",
    "id",
    "ps",
    "head",
    "tail",
    "wc",
    "find",
    "sync",
    "env",
    "tr",
    "cut",
    "sort",
    "uniq",
    "xargs",
    "rm",
    "dd",
    "date",
]


def ldd_deps(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    deps = []
    for line in out.splitlines():
        m = re.search(r"=>\s+(/\S+)", line) or re.match(r"\s*(/\S+)\s+\(", line)
        if m:
            deps.append(m.group(1))
    return deps


class Layer:
    def __init__(self) -> None:
        # path -> (kind, data, mode): data is the host file, link target or text
        self.entries: dict[str, tuple[str, str, int]] = {}

    def _parents(self, path: str) -> None:
        parts = Path(path).parts[1:-1]
        cur = ""
        for p in parts:
            cur += "/" + p
            self.entries.setdefault(cur, ("dir", "", 0o755))

    def add_dir(self, path: str, mode: int = 0o755) -> None:
        self._parents(path)
        self.entries[path] = ("dir", "", mode)

    def add_file(self, host: str, path: str) -> None:
        real = os.path.realpath(host)
        self._parents(path)
        self.entries[path] = ("file", real, 0)

    def add_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self._parents(path)
        self.entries[path] = ("text", text, mode)

    def add_symlink(self, path: str, target: str) -> None:
        self._parents(path)
        self.entries[path] = ("symlink", target, 0o777)

    def add_binary(self, host: str) -> None:
        self.add_file(host, host)
        for dep in ldd_deps(host):
            # Copy each library once, at its real path; the spelling the binary or
            # ld.so asks for (/lib/..., soname links) becomes a symlink to it.
            real = os.path.realpath(dep)
            self.add_file(real, real)
            if real != dep:
                self.add_symlink(dep, real)

    def tar_bytes(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for path in sorted(self.entries):
                kind, data, mode = self.entries[path]
                ti = tarfile.TarInfo(path.lstrip("/"))
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = "root"
                ti.mtime = 0
                if kind == "dir":
                    ti.type, ti.mode = tarfile.DIRTYPE, mode
                    tf.addfile(ti)
                elif kind == "symlink":
                    ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, data, mode
                    tf.addfile(ti)
                elif kind == "text":
                    raw = data.encode()
                    ti.size, ti.mode = len(raw), mode
                    tf.addfile(ti, io.BytesIO(raw))
                else:
                    st = os.stat(data)
                    ti.size, ti.mode = st.st_size, st.st_mode & 0o7777
                    with open(data, "rb") as f:
                        tf.addfile(ti, f)
        return buf.getvalue()


def blob(tf: tarfile.TarFile, raw: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    ti = tarfile.TarInfo("blobs/sha256/" + digest.split(":")[1])
    ti.size, ti.mode, ti.mtime = len(raw), 0o644, 0
    tf.addfile(ti, io.BytesIO(raw))
    return digest


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--name", required=True, help="image name without tag, e.g. fdp-e2e/pause")
    ap.add_argument("--out", required=True)
    ap.add_argument("--entrypoint", nargs="+", required=True)
    ap.add_argument("--file", action="append", default=[], help="HOST:IMAGEPATH")
    ap.add_argument("--binary", action="append", default=[], help="host binary + its libraries")
    ap.add_argument("--busybox", help="static busybox; installed as /bin/busybox with applet links")
    ap.add_argument("--text", action="append", default=[], help="IMAGEPATH:CONTENT")
    ap.add_argument("--dir", action="append", default=[], help="empty directory to create")
    args = ap.parse_args()

    layer = Layer()
    for d in ["/bin", "/dev", "/proc", "/sys", "/etc", "/tmp", "/mnt", "/root", "/run"]:
        layer.add_dir(d, 0o1777 if d == "/tmp" else 0o755)
    for d in args.dir:
        layer.add_dir(d)
    if args.busybox:
        layer.add_file(args.busybox, "/bin/busybox")
        for applet in BUSYBOX_APPLETS:
            layer.add_symlink("/bin/" + applet, "busybox")
    for spec in args.file:
        host, _, path = spec.partition(":")
        layer.add_file(host, path)
    for b in args.binary:
        layer.add_binary(b)
    for spec in args.text:
        path, _, content = spec.partition(":")
        layer.add_text(path, content.replace("\\n", "\n"))

    layer_raw = layer.tar_bytes()
    layer_digest = "sha256:" + hashlib.sha256(layer_raw).hexdigest()
    tag = layer_digest.split(":")[1][:12]
    ref = f"docker.io/{args.name}:{tag}"
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": args.entrypoint,
            "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "tests/kubelet/mkimage.py"}],
    }
    config_raw = json.dumps(config, sort_keys=True).encode()
    tmp = args.out + ".tmp"
    with tarfile.open(tmp, "w") as tf:
        blob(tf, layer_raw)
        config_digest = blob(tf, config_raw)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config_raw),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest,
                    "size": len(layer_raw),
                }
            ],
        }
        manifest_raw = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = blob(tf, manifest_raw)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest_raw),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
        for name, raw in [
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
            ("index.json", json.dumps(index, sort_keys=True).encode()),
        ]:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(raw), 0o644, 0
            tf.addfile(ti, io.BytesIO(raw))
    os.replace(tmp, args.out)
    print(ref)


if __name__ == "__main__":
    main()
