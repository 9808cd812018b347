#!/usr/bin/env python3
"""Regenerate fuse_plugin/api/ from protos/*.proto.

Usage: python scripts/gen_api.py [--out DIR]

The stubs are generated with the pinned grpcio-tools from the dev extras so that the
committed files are byte-for-byte reproducible; tests/unit/test_api_stubs.py regenerates into
a temporary directory and fails when the committed copy is stale.

Protos: api.proto (device plugin v1beta1), dra.proto (the kubelet's DRA v1 service) and
pluginregistration.proto (the kubelet's plugin watcher, v1), one stub set each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("api", "dra", "pluginregistration")
GENERATED = tuple(f"{proto}{suffix}" for proto in PROTOS
                  for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate(out_root: Path) -> list[Path]:
    """Generate into out_root/fuse_plugin/api and return the files written."""
    target = out_root / "fuse_plugin" / "api"
    target.mkdir(parents=True, exist_ok=True)
    # The virtual include path makes protoc emit package-absolute imports
    # ("from fuse_plugin.api import api_pb2") instead of a bare "import api_pb2".
    args = [
        "grpc_tools.protoc",
        f"-Ifuse_plugin/api={ROOT / 'protos'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"fuse_plugin/api/{proto}.proto" for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return [target / name for name in GENERATED]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT,
                        help="root to write fuse_plugin/api under")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
