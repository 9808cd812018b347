"""Benchmarks for fuse-device-plugin: ``python -m bench [--quick]`` (see bench/run.py)."""

import os

# gRPC's C core logs connection churn (GOAWAY on every kubelet restart) at INFO; the
# benchmark's own clients must not clutter the table. Set before grpc is imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
