"""``fuse-device-plugin demo``: the whole device-plugin flow on one machine, no cluster.

A newcomer's first command. Everything is real except the kubelet: the plugin is the
same ``Lifecycle`` that ``serve`` runs, on real unix sockets in a temp directory, and the
kubelet is ``KubeletStandIn``, which speaks the kubelet's side of the wire protocol. The
demo registers, shows the slots a node would advertise, restarts the "kubelet" to show
re-registration, asks for the Allocate answer a pod would get, and shuts down.

``--mount`` goes one step further where the machine allows it: it hands that Allocate
answer to runc and mounts a squashfs image with squashfuse inside an unprivileged
container confined by the generated seccomp profile (see ``container.py`` here).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from fuse_plugin import config, logs
from fuse_plugin.api import api_pb2 as api
from fuse_plugin.config import DEFAULT_FUSE_DEVICE, Settings
from fuse_plugin.demo import container
from fuse_plugin.demo.kubelet import KubeletStandIn
from fuse_plugin.deviceplugin.plugin import in_background
from fuse_plugin.devices import FUSE_MAJOR, FUSE_MINOR, Health, probe
from fuse_plugin.errors import Failure

WAIT = 15.0


class DemoError(Failure):
    """A step of the demo failed; the message is the one line the user sees."""


@dataclass(frozen=True)
class DemoDevice:
    path: Path
    note: str


def make_node(path: Path, major: int = FUSE_MAJOR, minor: int = FUSE_MINOR,
              mode: int = 0o600) -> Path:
    """Create a character device node (root only): the demo's and the tests' stand-in
    for /dev/fuse. The plugin only stat()s the node, so it behaves like the real one."""
    os.mknod(path, mode | stat.S_IFCHR, os.makedev(major, minor))
    os.chmod(path, mode)  # mknod applies the umask
    return path


def pick_device(workdir: Path, host_device: Path = DEFAULT_FUSE_DEVICE) -> DemoDevice:
    """The host's /dev/fuse when it is the real thing, else a stand-in node made here.

    The plugin only stat()s the node (it never opens it), so a char 10:229 made with
    mknod in the temp dir behaves exactly like /dev/fuse for everything but ``--mount``.
    """
    found = probe(host_device)
    if found.health is Health.HEALTHY:
        return DemoDevice(host_device, f"{found.reason}: the plugin only stat()s it")
    fake = workdir / "dev" / "fuse"
    fake.parent.mkdir(parents=True, exist_ok=True)
    try:
        make_node(fake)
    except PermissionError:
        return DemoDevice(fake, f"{found.reason}, and only root may mknod a stand-in: "
                                "every slot will be Unhealthy (that is the health check)")
    return DemoDevice(fake, f"{found.reason}, so the demo made a stand-in with mknod "
                            f"(char {FUSE_MAJOR}:{FUSE_MINOR}, in the temp dir)")


class Narrator:
    """Numbered steps and indented details: plain text that reads well when piped too."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._step = 0

    def step(self, text: str) -> None:
        self._step += 1
        self._out.write(f"\n{self._step}. {text}\n")
        self._out.flush()

    def detail(self, text: str) -> None:
        self._out.write(f"   {text}\n")
        self._out.flush()

    def line(self, text: str = "") -> None:
        self._out.write(f"{text}\n")
        self._out.flush()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def describe_allocation(response: api.AllocateResponse) -> list[str]:
    """The DeviceSpecs, mounts and env of an Allocate answer, one line each."""
    lines = []
    for index, answer in enumerate(response.container_responses):
        for spec in answer.devices:
            lines.append(f"container {index}: device container_path={spec.container_path} "
                         f"host_path={spec.host_path} permissions={spec.permissions}")
        lines += [f"container {index}: mount {m.host_path} -> {m.container_path}"
                  for m in answer.mounts]
        lines += [f"container {index}: env {k}={v}" for k, v in sorted(answer.envs.items())]
    return lines


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slots", type=config.slots, default=8,
                        help="slots the demo plugin advertises (default: 8)")
    parser.add_argument("--mount", action="store_true",
                        help="also mount a FUSE filesystem in a real unprivileged runc "
                             "container (root, runc, /dev/fuse, squashfuse)")


def run(parsed: argparse.Namespace) -> int:
    return show(sys.stdout, slots=parsed.slots, mount=parsed.mount)


def show(out: TextIO, slots: int, mount: bool = False) -> int:
    """The whole demo; returns 0, or raises DemoError with the line to show."""
    say = Narrator(out)
    say.line("fuse-device-plugin demo: the device-plugin flow on this machine, no cluster "
             "needed.")
    say.line("Real plugin, real unix sockets; a stand-in plays the kubelet.")
    with tempfile.TemporaryDirectory(prefix="fuse-demo-") as tmp:
        workdir = Path(tmp)
        device = pick_device(workdir)
        settings = Settings(device_plugin_dir=workdir / "device-plugins",
                            fuse_device=device.path, slots=slots, log_level="warning")
        say.step(f"A pretend node in {workdir}")
        say.detail(f"device-plugin dir {settings.device_plugin_dir}  "
                   "(on a node: /var/lib/kubelet/device-plugins)")
        say.detail(f"FUSE device       {device.path}  ({device.note})")
        with KubeletStandIn(settings.device_plugin_dir) as kubelet:
            say.step(f"Kubelet stand-in serving Registration on {kubelet.socket.name}")
            allocation = _plugin_flow(say, kubelet, settings)
        say.step("Kubelet stand-in stopped, temp dir removed: nothing left behind.")
    if mount:
        _mount_flow(say, allocation)
    say.line()
    say.line("Next: deploy with `kubectl apply -k manifests/`; a pod asks for the device with")
    say.line("  resources: {limits: {github.com/fuse: 1}}")
    return 0


def _plugin_flow(say: Narrator, kubelet: KubeletStandIn, settings: Settings
                 ) -> api.AllocateResponse | None:
    resource = settings.resource_name
    started = time.perf_counter()
    log = logs.setup(settings.log_format, settings.log_level)
    with in_background(settings, log) as running:
        plugin = running.lifecycle
        say.step(f"Plugin started (the code `serve` runs), {settings.slots} slots")
        try:
            registration = kubelet.wait_registered(1, WAIT)
        except TimeoutError as err:
            raise DemoError(f"the plugin did not register: {err}") from None
        say.detail(f"registered: resource {registration.resource}, endpoint "
                   f"{registration.endpoint}, API v1beta1, "
                   f"{_ms(registration.answered - started)} after start")
        devices = kubelet.wait_devices(resource, lambda d: len(d) == settings.slots, WAIT)
        capacity, allocatable = kubelet.capacity(resource)
        healthy = sorted(devices.values())[0] if devices else "none"
        say.step(f"Advertised over ListAndWatch: {len(devices)} slots, all {healthy}")
        say.detail(f"IDs {_id_range(list(devices))}; /dev/fuse is shared, so a slot is a "
                   "ticket, not a device")
        say.detail(f"the node would report capacity {resource}: {capacity}, "
                   f"allocatable: {allocatable}")

        restarted = time.perf_counter()
        kubelet.restart()
        try:
            again = kubelet.wait_registered(2, WAIT)
        except TimeoutError as err:
            raise DemoError(f"the plugin did not re-register after a kubelet restart: "
                            f"{err}") from None
        say.step("The kubelet restarts (it deletes every socket in its directory)")
        say.detail(f"the plugin saw it and registered again in "
                   f"{_ms(again.answered - restarted)}")
        kubelet.wait_devices(resource, lambda d: len(d) == settings.slots, WAIT)

        first = next(iter(kubelet.devices(resource)))
        say.step(f"A pod asks for {resource}: 1; the kubelet calls Allocate([{first}])")
        allocation: api.AllocateResponse | None = None
        try:
            allocation = kubelet.allocate(resource, [[first]])
        except grpc.RpcError as err:
            say.detail(f"refused: {err.code().name}: {err.details()}")
            say.detail("(the device is not usable here, so the kubelet would not start "
                       "the pod)")
        else:
            for text in describe_allocation(allocation):
                say.detail(text)
            say.detail("the runtime creates exactly this node in the container and allows "
                       "it in the device cgroup; nothing else from the host's /dev")
        socket = settings.socket_path
    say.step("Plugin stopped, as on SIGTERM when its pod is deleted")
    say.detail(f"its socket {'is still there (unexpected)' if socket.exists() else 'is removed'}")
    try:
        kubelet.wait_devices(resource, lambda d: all(h == "Unhealthy" for h in d.values()),
                             5.0)
        say.detail("the kubelet marks the slots Unhealthy until a plugin registers again; "
                   "running pods keep their /dev/fuse")
    except TimeoutError:
        say.detail("the kubelet still lists the slots as healthy (unexpected)")
    if plugin.status.serving:
        raise DemoError("the plugin did not stop serving")
    return allocation


def _id_range(ids: list[str]) -> str:
    if len(ids) <= 3:
        return ", ".join(ids)
    return f"{ids[0]}, {ids[1]} ... {ids[-1]}"


def _mount_flow(say: Narrator, allocation: api.AllocateResponse | None) -> None:
    say.step("--mount: a real unprivileged container mounts a FUSE filesystem")
    blockers = container.mount_blockers()
    if allocation is None:
        blockers.insert(0, "the plugin refused Allocate on this machine (no usable /dev/fuse)")
    if blockers:
        say.detail("skipped: this machine cannot run it:")
        for blocker in blockers:
            say.detail(f"  - {blocker}")
        return
    assert allocation is not None
    specs = list(allocation.container_responses[0].devices)
    try:
        result = container.run_mount_demo(specs)
    except container.ContainerError as err:
        raise DemoError(f"--mount: {err}") from None
    for text in result.setup:
        say.detail(text)
    say.detail("inside the container:")
    for text in result.output:
        say.detail(f"  | {text}")
