"""The broker under attack (issue 20): a tenant with what a real pod has (containerd's
default capabilities, CAP_SYS_CHROOT included, and the runtime-default seccomp rules of
Debian's containers-common, chroot and unshare included; CRI-O's with
FUSE_E2E_RUNTIME=crio, where the chroot attacks stop at chroot's EPERM) tries each way in
that a review found, against the real broker, while a well-behaved neighbour keeps
mounting. Each test names the principle it proves:

- paths are resolved from the caller's namespace root, whatever its root or cwd (chroot);
- nothing a tenant controls blocks the loop (daemons that never answer, renames racing
  the walk, descriptors, silent connections, the fd limit);
- quotas count what the kernel holds (lazily unmounted, pinned mounts);
- only containers that Allocate gave broker mode may ask (a shared-PID sibling, node
  processes), and only the broker's own mounts may be removed through it.
"""

from __future__ import annotations

import os
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.broker import protocol
from tests.lib import broker as broker_rig
from tests.lib import oci, profiles, runtimes, waiting, workloads
from tests.lib.broker import BrokerProcess, Held, attack
from tests.lib.workloads import squash_image

MAX_MOUNTS = 4
IMAGE = "/data/image.sqfs"
NEIGHBOUR_MOUNT = "/mnt/neighbour"


def pod(allocation: api.ContainerAllocateResponse | None, image: Path,
        extra: oci.Bind | None = None) -> oci.ContainerRequest:
    """A tenant's pod: the device and nothing else, the runtime's defaults."""
    binds = [broker_rig.attacker_bind(), oci.Bind(image, IMAGE, True)]
    return oci.ContainerRequest(
        args=workloads.HOLD, allocation=allocation, seccomp=profiles.runtime_default(),
        binds=[*binds, *([extra] if extra else [])])


class Scene:
    """A broker (--max-mounts 4), a neighbour that mounts squashfuse through the shim,
    and a fresh attacker container per test."""

    def __init__(self, broker: BrokerProcess, runc: oci.Runc, image: Path,
                 allocation: api.ContainerAllocateResponse) -> None:
        self.broker = broker
        self.runc = runc
        self.image = image
        self.allocation = allocation
        self.neighbour = runc.create(oci.build_spec(pod(allocation, image)),
                                     "neighbour").start()
        self._count = 0

    def attacker(self, extra: oci.Bind | None = None) -> oci.RuncContainer:
        self._count += 1
        spec = oci.build_spec(pod(self.allocation, self.image, extra))
        return self.runc.create(spec, f"attacker{self._count}").start()

    def neighbour_mounts(self, times: int = 1) -> oci.Result:
        """The neighbour mounts, reads and unmounts through the shim; every round must
        work, whatever the attacker does meanwhile."""
        script = (f"mkdir -p {NEIGHBOUR_MOUNT} && for i in $(seq {times}); do "
                  f"squashfuse {IMAGE} {NEIGHBOUR_MOUNT} && "
                  f"cat {NEIGHBOUR_MOUNT}/hello.txt >/dev/null && "
                  f"fusermount3 -u {NEIGHBOUR_MOUNT} || exit 1; done")
        return self.neighbour.sh(script, timeout=120)


@pytest.fixture(scope="module")
def scene_parts(broker_dir: Path, broker_allocation: api.ContainerAllocateResponse,
                tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[BrokerProcess, Path]]:
    work = tmp_path_factory.mktemp("hostile")
    broker = BrokerProcess(broker_dir, work / "broker", broker_rig.shim(),
                           "--max-mounts", str(MAX_MOUNTS))
    broker.start()
    try:
        yield broker, squash_image(work)
    finally:
        broker.stop()


@pytest.fixture
def scene(scene_parts: tuple[BrokerProcess, Path],
          broker_allocation: api.ContainerAllocateResponse) -> Iterator[Scene]:
    broker, image = scene_parts
    with oci.Runc() as runc:
        yield Scene(broker, runc, image, broker_allocation)


def mountinfo(container: oci.RuncContainer) -> str:
    return Path(f"/proc/{container.pid}/mountinfo").read_text()


def points(container: oci.RuncContainer) -> list[str]:
    return [line.split()[4] for line in mountinfo(container).splitlines()]


# -- resolve nothing from a root the caller chose -----------------------------------------


def chroot_refused(attacker: oci.RuncContainer) -> bool:
    """On a runtime whose tenant has no CAP_SYS_CHROOT (CRI-O, FUSE_E2E_RUNTIME=crio) the
    chroot attacks cannot take their first step: shown, not assumed, by chroot(2) in the
    attacker failing with EPERM. False where the tenant has it (containerd)."""
    if "CAP_SYS_CHROOT" in runtimes.default_capabilities():
        return False
    r = attacker.sh("python3 -c 'import os; os.chroot(\"/proc\")'")
    assert r.returncode != 0, r.output
    assert "Operation not permitted" in r.output, r.output
    return True



def test_a_chroot_race_cannot_unmount_the_runtimes_masks(scene: Scene) -> None:
    """The caller flips its root between /proc and a directory holding a FUSE decoy at
    keys and irq, and asks to unmount /keys and /irq: read in the caller's root at the
    wrong moment, that removes the masks over /proc/keys and /proc/irq. Resolved from
    the namespace's root, /keys is nothing."""
    attacker = scene.attacker()
    if chroot_refused(attacker):
        return
    attacker.sh("mkdir -p /mnt/decoy/keys /mnt/decoy/irq").check()
    decoys = [Held(attacker, "hold", f"/mnt/decoy/{name}") for name in ("keys", "irq")]
    assert [d.answer["status"] for d in decoys] == ["ok", "ok"]
    masks = {p for p in points(attacker) if p in ("/proc/keys", "/proc/irq")}
    assert masks == {"/proc/keys", "/proc/irq"}
    results = [attack(attacker, "chroot-race", root, "500", "op=unmount", f"path={path}")
               for root, path in (("/mnt/decoy", "/keys"), ("/proc", "/keys"),
                                  ("/mnt/decoy", "/irq"), ("/proc", "/irq"))]
    assert all("ok" not in r["counts"] for r in results), results
    assert {p for p in points(attacker) if p in ("/proc/keys", "/proc/irq")} == masks
    assert {p for p, _ in attacker.mounts()} == {"/mnt/decoy/keys", "/mnt/decoy/irq"}
    assert scene.broker.events("broker.unmount") == []
    scene.neighbour_mounts().check()


@pytest.mark.parametrize(("root", "path"), [
    ("/etc", "/ssl"),  # would land on /etc/ssl
    ("/proc/sys", "/kernel"),  # /proc/sys/kernel
    ("/proc/1", "/attr"),  # /proc/1/attr, where runc writes the AppArmor label on exec
    ("/usr", "/local/bin"),  # /usr/local/bin
    ("/run", "/fuse-broker"),  # /run/fuse-broker: the container's way to the broker
])
def test_a_chrooted_caller_cannot_mount_into_system_trees(scene: Scene, root: str,
                                                          path: str) -> None:
    attacker = scene.attacker()
    if chroot_refused(attacker):
        return
    answer = attack(attacker, "chroot-ask", root, "op=mount", f"path={path}")
    assert answer["status"] == "error"
    assert "not its mount namespace's root (chroot)" in answer["message"]
    assert attacker.mounts() == []


# -- nothing a tenant controls blocks the loop --------------------------------------------


def test_a_daemon_that_never_answers_cannot_stall_the_broker(scene: Scene) -> None:
    """A FUSE mount whose daemon never reads its device: every lookup in it waits. The
    attacker asks for mountpoints inside it, and swaps directories so that a path that
    looked plain leads through it; the broker resolves nothing there, so every request is
    answered and the neighbour's mounts go on."""
    attacker = scene.attacker()
    attacker.sh("mkdir -p /mnt/a/f /mnt/b/f/x /mnt/a/plain").check()
    stall = Held(attacker, "hold", "/mnt/a/f")
    assert stall.answer["status"] == "ok"
    inside = attack(attacker, "ask", "--fuse", "op=mount", "path=/mnt/a/f/x")
    assert "is at or inside the fuse mount at '/mnt/a/f'" in inside["message"]
    neighbour = subprocess.Popen(
        scene.neighbour.runc.command("exec", scene.neighbour.id, "/bin/sh", "-c",
                                     f"mkdir -p {NEIGHBOUR_MOUNT} && for i in $(seq 30); do "
                                     f"squashfuse {IMAGE} {NEIGHBOUR_MOUNT} && "
                                     f"fusermount3 -u {NEIGHBOUR_MOUNT} || exit 1; done"))
    race = attack(attacker, "rename-race", "/mnt/a", "/mnt/b", "600", "/mnt/b/f/x",
                  "/mnt/b/f")
    assert neighbour.wait(120) == 0
    assert race["swaps"] > 0
    # Every request was answered, each with one of these reasons: nothing timed out.
    assert "closed" not in race["counts"], race
    expected = ("is at or inside the fuse mount at", "it does not exist",
                "mount table changed", f"its limit (--max-mounts {MAX_MOUNTS})")
    odd = [m for m in race["messages"] if not any(words in m for words in expected)]
    assert odd == []
    assert any("is at or inside the fuse mount" in m for m in race["messages"])
    assert scene.broker.events("broker.stalled") == []
    assert scene.broker.events("broker.failed") == []
    stall.release()


def test_descriptors_sent_to_the_broker_are_refused_by_the_kernel(scene: Scene) -> None:
    """A TCP socket whose close would linger for an hour, attached to a request: the
    socket refuses descriptors (SO_PASSRIGHTS), so the sender's own sendmsg fails and
    the broker never holds the file; the neighbour is served meanwhile."""
    if not scene.broker.events("broker.serving")[0]["refuses_descriptors"]:
        pytest.skip("this kernel has no SO_PASSRIGHTS (Linux 6.16+)")
    attacker = scene.attacker()
    held = Held(attacker, "descriptors")
    assert held.answer == {"sent": False, "error": "Operation not permitted"}
    scene.neighbour_mounts(3).check()
    held.release()


def test_silent_connections_take_only_the_attackers_share(scene: Scene) -> None:
    attacker = scene.attacker()
    held = Held(attacker, "silent", "300", "--settle")
    from fuse_plugin.broker.shares import PER_CONTAINER

    assert held.answer["held"] == PER_CONTAINER
    assert sum(held.answer["refused"].values()) == 300 - PER_CONTAINER
    scene.neighbour_mounts(3).check()
    lines = [e for e in scene.broker.events("broker.refused") if e.get("kind") == "busy"]
    assert 1 <= len(lines) < 10, "floods are summed up, not logged per connection"
    held.release()


def test_out_of_fds_the_broker_pauses_says_so_once_and_recovers(scene: Scene) -> None:
    """With the broker at its fd limit, accept fails: the broker stops accepting for a
    moment instead of spinning on the error, and serves again once fds are free."""
    broker = scene.broker
    attacker = scene.attacker()
    used = {int(fd) for fd in os.listdir(f"/proc/{broker.pid}/fd")}
    lowest_free = min(set(range(len(used) + 1)) - used)
    soft, hard = resource.prlimit(broker.pid, resource.RLIMIT_NOFILE)
    try:
        # No fd number left below the limit: the next accept fails with EMFILE.
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (lowest_free, hard))
        held = Held(attacker, "silent", "4")
        waiting.wait_for(lambda: broker.events("broker.accept_paused"), 30,
                           "the broker to pause accepting at its fd limit")
        held.release()
    finally:
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (soft, hard))
    scene.neighbour_mounts().check()
    paused = broker.events("broker.accept_paused")
    assert len(paused) < 50, f"{len(paused)} lines: the accept error path spins"


# -- quotas count what the kernel holds ---------------------------------------------------


def test_mounts_pinned_and_lazily_unmounted_still_count(scene: Scene) -> None:
    """Mount, keep the mount alive with an O_PATH fd, lazily unmount it (no table shows
    it any more), repeat: the broker counts live FUSE connections, so the container gets
    its quota and no more."""
    attacker = scene.attacker()
    held = Held(attacker, "pin-and-hide", "20", "/mnt/q")
    assert held.answer["mounted"] == MAX_MOUNTS
    assert held.answer["counts"] == {"ok": MAX_MOUNTS, "error": 20 - MAX_MOUNTS}
    assert attacker.mounts() == []  # hidden: unmounted from every table
    held.release()
    # Released: the kernel drops the connections, and the quota is free again.
    waiting.wait_for(lambda: attack(attacker, "ask", "--fuse", "op=mount",
                                      "path=/mnt")["status"] == "ok", 30,
                       "the quota to free up once the hidden mounts are gone")


# -- only containers that were allocated the device may ask -------------------------------


def test_a_sibling_without_the_device_in_the_same_pod_is_refused(scene: Scene) -> None:
    """Pods may share one PID namespace: a sibling container without github.com/fuse
    reaches the socket through /proc/1/root. It cannot open /dev/fuse (no device rule)
    and its namespace has no broker-mode bind, so it gets nothing."""
    first = scene.attacker()
    spec = oci.build_spec(pod(None, scene.image))
    for namespace in spec["linux"]["namespaces"]:
        if namespace["type"] == "pid":
            namespace["path"] = f"/proc/{first.pid}/ns/pid"
    sibling = scene.runc.create(spec, "sibling").start()
    sibling.sh("mkdir -p /mnt/s").check()
    socket_path = "/proc/1/root" + protocol.CONTAINER_SOCKET
    env = {protocol.SOCKET_ENV: socket_path}
    opened = sibling.sh("exec 3<>/proc/1/root/dev/fuse")
    assert opened.returncode != 0
    for fd in ("0", "1"):
        answer = attack(sibling, "ask", "--fd", fd, "op=mount", "path=/mnt/s", env=env)
        assert answer["status"] == "error"
        assert "is not /dev/fuse" in answer["message"]
    answer = attack(sibling, "ask", "op=unmount", "path=/mnt/s", env=env)
    assert answer["status"] == "error"
    assert "not a mount the broker made for this container" in answer["message"]
    assert sibling.mounts() == []


def test_a_fuse_volume_the_node_placed_cannot_be_unmounted_through_the_broker(
        scene: Scene, tmp_path: Path) -> None:
    """A FUSE mount the node made (a CSI driver's volume, lxcfs's files) is not the
    broker's to remove, even at the container's request."""
    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["squashfuse", str(scene.image), str(volume)], check=True, timeout=30)
    try:
        attacker = scene.attacker(extra=oci.Bind(volume, "/vol", True))
        assert ("/vol", "fuse.squashfuse") in attacker.mounts()
        result = attacker.exec("fusermount3", "-u", "/vol")
        assert result.returncode == 1
        assert "not a mount the broker made for this container" in result.stderr
        assert ("/vol", "fuse.squashfuse") in attacker.mounts()
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False, timeout=30)


NODE_ROOT_TRIES = {
    "a private mount namespace, no capability": [
        "unshare", "--mount", "--propagation", "private", "setpriv", "--inh-caps=-all",
        "--bounding-set=-all", "--"],
    "a user namespace of its own with the broker's directory bound in": [
        "unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
        'mount -t tmpfs none /run && mkdir /run/fuse-broker && '
        'mount --bind "$BROKER_DIR" /run/fuse-broker && '
        'exec "$@"', "sh"],
}


@pytest.mark.parametrize("how", list(NODE_ROOT_TRIES))
def test_a_node_process_is_refused(scene: Scene, tmp_path: Path, how: str) -> None:
    """Root on the node without CAP_SYS_ADMIN, in a mount namespace of its own: it can
    reach the socket and open /dev/fuse, but Allocate never gave it broker mode."""
    target = tmp_path / "mnt"
    target.mkdir()
    shim = scene.broker.directory / protocol.SHIM_NAME
    result = subprocess.run(
        [*NODE_ROOT_TRIES[how], str(shim), "-o", "rw", str(target)],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "_FUSE_COMMFD": "3",
             "BROKER_DIR": str(scene.broker.directory),
             protocol.SOCKET_ENV: str(scene.broker.socket)},
        capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert "fusermount3: broker refused:" in result.stderr
    assert ("not given broker mode" in result.stderr
            or "maps the node's uid 0" in result.stderr), result.stderr
    assert not os.path.ismount(target)


STUCK_HELPER = broker_rig.stuck_helper()


def test_a_helper_stuck_on_a_tenants_daemon_is_freed_by_aborting_its_connections(
        scene_parts: tuple[BrokerProcess, Path], tmp_path: Path) -> None:
    """Nothing in the broker's own helper walks into a FUSE mount, but if a helper were
    ever caught by a tenant's daemon (in the kernel, where SIGKILL cannot reach it), the
    broker aborts the FUSE connections it made for that container, which frees it, and
    says so. The mount was made by an earlier broker: the records survive a restart."""
    _, image = scene_parts
    broker_dir = tmp_path / "broker-dir"
    allocation = broker_rig.allocation(tmp_path / "plugin", broker_dir)
    real = BrokerProcess(broker_dir, tmp_path / "real", broker_rig.shim()).start()
    with oci.Runc() as runc:
        attacker = runc.create(oci.build_spec(pod(allocation, image)), "stuck").start()
        attacker.sh("mkdir -p /mnt/stall /mnt/other").check()
        stall = Held(attacker, "hold", "/mnt/stall")
        assert stall.answer["status"] == "ok"
        [connection] = attacker.fuse_connections()
        stuck = broker_rig.with_stand_in_helper(real, STUCK_HELPER, tmp_path / "stuck")
        stuck.start()
        try:
            answer = attack(attacker, "ask", "--fuse", "op=mount", "path=/mnt/other")
            assert "did not finish within" in answer["message"]
            [aborted] = waiting.wait_for(lambda: stuck.events("broker.aborted"), 60,
                                           "the broker to abort the container's FUSE "
                                           "connections")
            assert aborted["connections"] == [connection]
            assert stuck.events("broker.stalled")
            # The helper is free and gone, and the broker serves on.
            assert attack(attacker, "ask", "op=unmount", "path=/mnt/nothing")["status"] \
                == "error"
        finally:
            stuck.stop()
            stall.release()


def test_a_mountpoint_on_a_shared_mount_is_refused(scene: Scene, tmp_path: Path) -> None:
    """A volume shared with the node (mountPropagation: Bidirectional, or a node mount in
    a peer group): a FUSE mount made on it would propagate out of the container."""
    shared = tmp_path / "shared"
    (shared / "sub").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(shared), str(shared)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "--make-shared", str(shared)], check=True, timeout=30)
        attacker = scene.attacker(extra=oci.Bind(shared, "/vol", propagation="rshared"))
        answer = attack(attacker, "ask", "--fuse", "op=mount", "path=/vol/sub")
        assert answer["status"] == "error"
        assert "is on a shared mount" in answer["message"]
        assert attacker.mounts() == []
        assert oci.fuse_mounts_of(os.getpid()) == []  # nothing reached the node
    finally:
        subprocess.run(["umount", "-l", str(shared)], check=False, timeout=30)
