"""Fixtures for the real-container tests: the machine check (skip, saying why, only where
the machine cannot run containers with FUSE), the plugin's real Allocate answer, runc,
and the servers."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.containers import oci, plugin
from tests.containers.servers import Moto, Sshd

FUSE = Path("/dev/fuse")


def _fuse_device_problem() -> str:
    try:
        st = FUSE.stat()
    except FileNotFoundError:
        return "no /dev/fuse on this machine (FUSE not available in the kernel or VM)"
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (10, 229):
        return "/dev/fuse is not the FUSE character device 10:229"
    return ""


def machine_problem() -> str:
    """Why this machine cannot run the container tests, or '' when it can."""
    if os.geteuid() != 0:
        return "needs root: runc containers with cgroups, device nodes and mounts"
    problem = _fuse_device_problem()
    if problem:
        return problem
    if shutil.which(oci.RUNC) is None:
        return "runc is not installed (scripts/install --dev installs it)"
    if not Path("/sys/fs/cgroup/devices").is_dir() and not Path(
            "/sys/fs/cgroup/cgroup.controllers").exists():
        return "no devices cgroup: the device allow-list cannot be enforced here"
    if not oci.ensure_fusectl():
        return ("fusectl (/sys/fs/fuse/connections) cannot be mounted: a hung FUSE "
                "test could not be aborted")
    return ""


@pytest.fixture(scope="session")
def machine() -> None:
    problem = machine_problem()
    if problem:
        pytest.skip(f"real-container tests skipped: {problem}")


@pytest.fixture(scope="session")
def allocation(machine: None, tmp_path_factory: pytest.TempPathFactory
               ) -> api.ContainerAllocateResponse:
    """The plugin's ContainerAllocateResponse, fetched over its real socket."""
    response = plugin.allocate(tmp_path_factory.mktemp("device-plugins"))
    assert [(d.host_path, d.container_path, d.permissions) for d in response.devices] == [
        (str(FUSE), str(FUSE), "rw")]
    return response


@pytest.fixture
def runc(machine: None) -> Iterator[oci.Runc]:
    runner = oci.Runc()
    try:
        yield runner
    finally:
        runner.close()


def _need(tool: str) -> None:
    from tests.containers.workloads import missing_tool

    problem = missing_tool(tool)
    if problem:
        pytest.fail(problem)


@pytest.fixture(scope="session")
def moto(machine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    _need("s3fs")
    server = Moto(tmp_path_factory.mktemp("moto"))
    try:
        server.start()
        server.client().create_bucket(Bucket="fuse-e2e")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sshd(machine: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    _need("sshfs")
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
