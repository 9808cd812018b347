"""The DRA driver under test: assembled in-process over real unix sockets and a real
HTTP fake API server, with a device prober the test can flip, and a kubelet-side client
for the two gRPC services; and the fixtures the DRA test modules share (a module takes
one under the name its tests use: ``root = dra.short_root_fixture``)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from fuse_plugin import logs
from fuse_plugin.api import dra_pb2 as dra
from fuse_plugin.api import dra_pb2_grpc, pluginregistration_pb2_grpc
from fuse_plugin.api import pluginregistration_pb2 as reg
from fuse_plugin.devices import Health, Probe
from fuse_plugin.dra import driver
from fuse_plugin.dra.claims import ApiClaims
from fuse_plugin.dra.settings import DRIVER_NAME, DraSettings
from fuse_plugin.dra.slices import LightkubeSlices
from tests.lib import apiserver
from tests.lib.apiserver import FakeApiServer, claim

NODE = "node-1"
NS = "team-a"  # the namespace of the tests' claims
RPC_TIMEOUT = 10.0


@dataclass
class FlipProber:
    """Healthy until the test says otherwise; stands in for stat() of /dev/fuse."""

    healthy: bool = True
    calls: int = field(default=0)

    def __call__(self, path: Path) -> Probe:
        self.calls += 1
        if self.healthy:
            return Probe(Health.HEALTHY, f"{path} is char 10:229")
        return Probe(Health.UNHEALTHY, f"{path} does not exist")


def short_dir() -> Path:
    """A temp dir short enough for unix socket paths (pytest's tmp_path may not be); the
    caller removes it (``short_root``)."""
    return Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))


@contextmanager
def short_root() -> Iterator[Path]:
    """``short_dir``, removed afterwards: for tests that run the driver twice in one dir."""
    root = short_dir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def short_root_fixture() -> Iterator[Path]:
    """``short_root`` as a fixture."""
    with short_root() as path:
        yield path


@pytest.fixture
def node_api_fixture() -> Iterator[FakeApiServer]:
    """The fake API server, holding this node's Node."""
    with apiserver.running() as server:
        server.add_node(NODE)
        yield server


def add_claim(api: FakeApiServer, name: str, **kwargs: Any) -> tuple[str, str, str]:
    """A claim of this driver in NS, named ``name`` with a new uid (``apiserver.claim``'s
    keywords); the (namespace, name, uid) the kubelet names it by."""
    uid = str(uuid.uuid4())
    api.add_claim(claim(NS, name, uid, DRIVER_NAME, **kwargs))
    return NS, name, uid


def settings_in(root: Path, **changes: Any) -> DraSettings:
    base = DraSettings(node_name=NODE, plugins_dir=root / "plugins",
                       registry_dir=root / "registry", cdi_dir=root / "cdi",
                       fuse_device=root / "fuse", broker_dir=root / "broker",
                       resync_seconds=3600)
    return replace(base, **changes)


def lightkube_client(server: FakeApiServer) -> Any:
    from lightkube import Client, KubeConfig

    return Client(config=KubeConfig.from_dict(server.kubeconfig_dict()), trust_env=False,
                  field_manager=DRIVER_NAME)


@dataclass
class Kubelet:
    """The kubelet's side of the two services, on the driver's real sockets."""

    settings: DraSettings

    @contextmanager
    def _channel(self, path: Path) -> Iterator[grpc.Channel]:
        channel = grpc.insecure_channel(f"unix://{path}")
        try:
            yield channel
        finally:
            channel.close()

    def get_info(self) -> reg.PluginInfo:
        with self._channel(self.settings.registration_socket) as channel:
            stub = pluginregistration_pb2_grpc.RegistrationStub(channel)
            info: reg.PluginInfo = stub.GetInfo(reg.InfoRequest(), timeout=RPC_TIMEOUT)
            return info

    def notify(self, registered: bool, error: str = "") -> None:
        with self._channel(self.settings.registration_socket) as channel:
            stub = pluginregistration_pb2_grpc.RegistrationStub(channel)
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=registered, error=error),
                timeout=RPC_TIMEOUT)

    def prepare(self, *claims: tuple[str, str, str]) -> dra.NodePrepareResourcesResponse:
        """Claims as (namespace, name, uid), on the endpoint GetInfo named."""
        with self._channel(Path(self.get_info().endpoint)) as channel:
            stub = dra_pb2_grpc.DRAPluginStub(channel)
            request = dra.NodePrepareResourcesRequest(
                claims=[dra.Claim(namespace=n, name=m, uid=u) for n, m, u in claims])
            response: dra.NodePrepareResourcesResponse = stub.NodePrepareResources(
                request, timeout=RPC_TIMEOUT)
            return response

    def unprepare(self, *claims: tuple[str, str, str]) -> dra.NodeUnprepareResourcesResponse:
        with self._channel(self.settings.service_socket) as channel:
            stub = dra_pb2_grpc.DRAPluginStub(channel)
            request = dra.NodeUnprepareResourcesRequest(
                claims=[dra.Claim(namespace=n, name=m, uid=u) for n, m, u in claims])
            response: dra.NodeUnprepareResourcesResponse = stub.NodeUnprepareResources(
                request, timeout=RPC_TIMEOUT)
            return response


@dataclass
class Rig:
    api: FakeApiServer
    settings: DraSettings
    prober: FlipProber
    driver: driver.Driver
    kubelet: Kubelet


@contextmanager
def running_driver(api: FakeApiServer, *, publish: bool = True,
                   log: logging.Logger | None = None, root: Path | None = None,
                   prober: FlipProber | None = None, **changes: Any) -> Iterator[Rig]:
    """The driver on its own sockets under a short temp dir, its loop on a thread."""
    own_root = root is None
    root = root or short_dir()
    prober = prober or FlipProber()
    settings = settings_in(root, publish=publish, **changes)
    client = lightkube_client(api)
    log = log or logs.setup("text", "debug")
    try:
        with driver.in_background(settings, log, ApiClaims(client),
                                  LightkubeSlices(client) if publish else None,
                                  prober) as running:
            yield Rig(api, settings, prober, running, Kubelet(settings))
    finally:
        client.close()
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
