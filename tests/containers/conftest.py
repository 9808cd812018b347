"""Fixtures for the real-container tests: the machine check (skip, saying why, only where
the machine cannot run containers with FUSE), the plugin's real Allocate answer, runc,
and the servers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from tests.lib import broker as broker_rig
from tests.lib import oci, plugin
from tests.lib.lxcfs import LxcfsInstance
from tests.lib.servers import Moto, Sshd

FUSE = Path("/dev/fuse")


def machine_problem() -> str:
    """Why this machine cannot run the container tests, or '' when it can."""
    blockers = oci.runc_blockers(FUSE)
    if blockers:
        return blockers[0]
    if not Path("/sys/fs/cgroup/devices").is_dir() and not Path(
            "/sys/fs/cgroup/cgroup.controllers").exists():
        return "no devices cgroup: the device allow-list cannot be enforced here"
    if not oci.ensure_fusectl():
        return ("fusectl (/sys/fs/fuse/connections) cannot be mounted: a hung FUSE "
                "test could not be aborted")
    return ""


@pytest.fixture(scope="session")
def machine(udev_fuse: None) -> None:
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
    from tests.lib.workloads import missing_tool

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


# -- broker mode (docs/broker.md) ---------------------------------------------------------


@pytest.fixture(scope="session")
def broker_dir(machine: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The host directory the plugin's --broker-dir names, shared by every broker test."""
    return tmp_path_factory.mktemp("broker-dir")


@pytest.fixture(scope="session")
def broker_allocation(broker_dir: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> api.ContainerAllocateResponse:
    """The real plugin's Allocate answer in broker mode."""
    return broker_rig.allocation(tmp_path_factory.mktemp("device-plugins-broker"), broker_dir)


@pytest.fixture
def broker(broker_dir: Path, tmp_path: Path) -> Iterator[broker_rig.BrokerProcess]:
    """A running broker with its own log; stopped (SIGTERM) afterwards."""
    process = broker_rig.BrokerProcess(broker_dir, tmp_path / "broker-run", broker_rig.shim())
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.fixture
def lxcfs_dir(tmp_path: Path) -> Path:
    """Where the broker listens for lxcfs (its --lxcfs-dir)."""
    return tmp_path / "lxcfs-socket"


@pytest.fixture
def views_broker(broker_dir: Path, lxcfs_dir: Path, tmp_path: Path
                 ) -> Iterator[broker_rig.BrokerProcess]:
    """A broker that serves LXCFS views on its own lxcfs socket."""
    process = broker_rig.BrokerProcess(broker_dir, tmp_path / "broker-run", broker_rig.shim(),
                                       "--lxcfs-dir", str(lxcfs_dir))
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.fixture
def node_lxcfs(views_broker: broker_rig.BrokerProcess, lxcfs_dir: Path, tmp_path: Path
               ) -> Iterator[LxcfsInstance]:
    """The node's lxcfs, announced to ``views_broker``."""
    instance = LxcfsInstance(lxcfs_dir, tmp_path / "lxcfs-run")
    try:
        yield instance.start()
    finally:
        instance.stop()
