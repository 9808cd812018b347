"""The real kubelet: a standalone kubelet 1.37, containerd 2.3 and runc 1.4, built from
their Go modules by tests/stack/build.sh, start static pods that use our device plugin.

Everything is asserted from the kubelet's own reports: pod status from its
read-only port (``/pods``), its log (``--v=2``) and the container logs it keeps
under /var/log/pods.  Standalone, the kubelet has no API server to publish its
node object to; it logs ``Updated capacity for device plugin`` whenever it
rebuilds the node for admission, and admits or refuses pods against it.

Setup (packages, the cached kubelet build, images) is tests/kubelet/setup.sh;
the processes are started and torn down by recorded PID in tests/kubelet/node.py.
Logs stay in /var/log/fuse-device-plugin-e2e/ (evidence.txt: the lines that prove
each scenario).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kubelet import node as nodemod
from tests.kubelet.static_pods import (
    KUBELET_LOG,
    RESOURCE,
    SECCOMP_SUBDIR,
    SLOTS,
    container,
    evidence,
    kubelet_lines,
    pod_spec,
    pods,
    wait_registered,
)

# The kubelet's line when the Node's capacity of our resource changes (1.37's wording).
ENDED = r'ListAndWatch ended unexpectedly for device plugin".* resource="github.com/fuse"'
CAPACITY = r'Updated capacity for device plugin" plugin="github.com/fuse" capacity=\d+'


def plugin_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(nodemod.find_plugin()), *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def seccomp_profiles(kube_node: Any) -> Iterator[dict[str, str]]:
    """Our sshfs seccomp profile, made by `fuse-device-plugin profile seccomp` and installed
    under the kubelet's seccomp root by `fuse-device-plugin install-profiles`; plus, for the
    negative control, the same profile without our additions (mount, umount2)."""
    helps = [plugin_cli("profile", "seccomp", "--help"), plugin_cli("install-profiles", "--help")]
    missing = [h for h in helps if h.returncode != 0]
    assert not missing, (
        "expected the plugin's `profile seccomp` and `install-profiles` commands (issue 3); got:\n"
        + "\n".join(h.stderr.strip() for h in missing)
    )
    src = nodemod.STATE / "profiles"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    r = plugin_cli("profile", "seccomp", "--preset", "sshfs", "--output", str(src / "sshfs.json"))
    assert r.returncode == 0, f"profile seccomp --preset sshfs failed: {r.stderr}"
    prof = json.loads((src / "sshfs.json").read_text())
    stripped = json.loads(json.dumps(prof))
    for rule in stripped.get("syscalls", []):
        rule["names"] = [n for n in rule["names"] if n not in ("mount", "umount2")]
    stripped["syscalls"] = [r for r in stripped.get("syscalls", []) if r["names"]]
    (src / "sshfs-without-mount.json").write_text(json.dumps(stripped, indent=1))
    dest = nodemod.SECCOMP_ROOT / SECCOMP_SUBDIR
    existed = dest.exists()
    argv = [
        str(nodemod.find_plugin()),
        "install-profiles",
        "--source",
        str(src),
        "--seccomp-dir",
        str(dest),
        # no AppArmor profiles in DIR; keep the installer away from /etc/apparmor.d anyway
        "--apparmor-dir",
        str(nodemod.STATE / "apparmor.d"),
        # sshfs-without-mount.json is not a preset's profile: by default it is refused
        "--allow-custom-profiles",
    ]
    if "--once" in helps[1].stdout:
        r = subprocess.run(
            [*argv, "--once"], capture_output=True, text=True, timeout=60, check=False
        )
        said = r.stdout + r.stderr
        assert r.returncode == 0, f"install-profiles --once failed ({r.returncode}): {said}"
    else:
        # The installer keeps watching DIR (a ConfigMap on a real node): run it as a recorded
        # process, wait until it has installed the profiles, then stop it by its PID.
        kube_node.spawn("installer", argv)
        said = ""

    def installed() -> bool:
        return all(
            (dest / f).is_file()
            and json.loads((dest / f).read_text()) == json.loads((src / f).read_text())
            for f in ["sshfs.json", "sshfs-without-mount.json"]
        )

    nodemod.wait_for(
        installed,
        30,
        f"install-profiles to install sshfs.json and sshfs-without-mount.json in {dest}",
        detail=lambda: said + nodemod.tail(nodemod.LOGDIR / "installer.log"),
    )
    if kube_node.alive("installer"):
        kube_node.stop("installer")
    evidence("sshfs-profile",
             f"installed by our installer: {sorted(p.name for p in dest.iterdir())} in {dest}")
    yield {
        "sshfs": f"{SECCOMP_SUBDIR}/sshfs.json",
        "without_mount": f"{SECCOMP_SUBDIR}/sshfs-without-mount.json",
    }
    if not existed:
        shutil.rmtree(dest, ignore_errors=True)


# ---------------------------------------------------------------- scenarios

DEVICES_SCRIPT = r"""
for f in $(find /dev -type c -o -type b); do stat -c 'DEV %n %t:%T' "$f"; done
sed 's/^/CGROUP /' /sys/fs/cgroup/devices/devices.list
if [ -c /dev/fuse ] && (exec 3<>/dev/fuse) 2>/dev/null
then echo OPEN_FUSE_OK
else echo OPEN_FUSE_FAILED
fi
"""


def test_node_advertises_slots(kube_node: Any) -> None:
    """The node's capacity for github.com/fuse is our slot count; all of it is allocatable."""
    with pods(
        kube_node, **{"all-slots": pod_spec(container(kube_node, "ls -l /dev/fuse", fuse=SLOTS))}
    ) as runs:
        run = runs["all-slots"]
        run.expect("Succeeded")
        cap = kubelet_lines(run.since, CAPACITY)
        assert cap, (
            f"expected the kubelet to log 'Updated capacity for device plugin' {RESOURCE}={SLOTS}\n"
            + run.report()
        )
        values = {int(ln.rsplit("capacity=", 1)[1]) for ln in cap}
        assert values == {SLOTS}, f"expected capacity {SLOTS}, the kubelet logged:\n" + "\n".join(
            cap
        )
        evidence("capacity",
                 [cap[-1], f"pod requesting {RESOURCE}: {SLOTS} (all slots) -> {run.phase}"])


def test_fuse_pod_sees_dev_fuse_and_nothing_else(kube_node: Any) -> None:
    with pods(
        kube_node,
        baseline=pod_spec(container(kube_node, DEVICES_SCRIPT, fuse=None)),
        withfuse=pod_spec(container(kube_node, DEVICES_SCRIPT, fuse=1)),
    ) as runs:
        base, fuse = runs["baseline"], runs["withfuse"]
        base.expect("Succeeded")
        fuse.expect("Succeeded")

        def parse(text: str, tag: str) -> set[str]:
            return {
                ln[len(tag) + 1 :].strip() for ln in text.splitlines() if ln.startswith(tag + " ")
            }

        blog, flog = base.log(), fuse.log()
        added_devs = parse(flog, "DEV") - parse(blog, "DEV")
        removed_devs = parse(blog, "DEV") - parse(flog, "DEV")
        added_rules = parse(flog, "CGROUP") - parse(blog, "CGROUP")
        assert not removed_devs, f"the fuse pod lacks devices the baseline pod has: {removed_devs}"
        assert added_devs == {"/dev/fuse a:e5"}, (
            "expected the fuse pod to see exactly one added device node, "
            "/dev/fuse (10:229 = a:e5 hex); "
            f"added {added_devs}, missing {removed_devs}\n{fuse.report()}"
        )
        assert added_rules == {"c 10:229 rw"}, (
            f"expected exactly one added devices-cgroup rule 'c 10:229 rw'; got {added_rules}\n"
            + fuse.report()
        )
        assert "OPEN_FUSE_OK" in flog, (
            f"expected the fuse pod to open /dev/fuse rw\n{fuse.report()}"
        )
        assert "OPEN_FUSE_FAILED" in blog, (
            f"expected the baseline pod not to open /dev/fuse\n{base.report()}"
        )
        alloc = [
            ln
            for ln in nodemod.read_log(nodemod.LOGDIR / "plugin.log").splitlines()
            if "llocat" in ln
        ]
        evidence("only-dev-fuse",
            [
                f"fuse pod: added devices {sorted(added_devs)}, "
                f"added cgroup rules {sorted(added_rules)}, "
                "/dev/fuse opened rw; baseline pod: no /dev/fuse",
                *kubelet_lines(fuse.since, r"ContainerStarted")[-1:],
                *alloc[-1:],
            ],
        )


SSHFS_SCRIPT = r"""
set -e
grep -E '^(Seccomp|CapEff):' /proc/self/status
mkdir -p /mnt/remote
sshfs -o IdentityFile=/keys/client,StrictHostKeyChecking=no \
    -o UserKnownHostsFile=/dev/null,port=$PORT \
    root@127.0.0.1:$EXPORT /mnt/remote
grep ' /mnt/remote ' /proc/mounts | sed 's/^/MOUNTED /'
echo "$PAYLOAD" > /mnt/remote/$POD_NAME.txt
umount /mnt/remote
echo WROTE_AND_UNMOUNTED
"""


def sshfs_pod(
    node: Any,
    sshd: dict[str, Any],
    name: str,
    seccomp: dict[str, str] | None,
    sys_admin: bool = True,
) -> tuple[dict[str, Any], str]:
    payload = f"written by pod {name} {uuid.uuid4()}"
    sc: dict[str, Any] = {}
    if sys_admin:
        sc["capabilities"] = {"add": ["SYS_ADMIN"]}
    if seccomp:
        sc["seccompProfile"] = seccomp
    c = container(
        node,
        SSHFS_SCRIPT,
        fuse=1,
        securityContext=sc,
        env=[
            {"name": "PORT", "value": str(sshd["port"])},
            {"name": "EXPORT", "value": str(sshd["export"])},
            {"name": "PAYLOAD", "value": payload},
            {"name": "POD_NAME", "value": name},
        ],
        volumeMounts=[{"name": "keys", "mountPath": "/keys", "readOnly": True}],
    )
    vols = [{"name": "keys", "hostPath": {"path": str(sshd["dir"] / "keys"), "type": "Directory"}}]
    return pod_spec(c, volumes=vols), payload


def test_sshfs_with_our_seccomp_profile(
    kube_node: Any, sshd: dict[str, Any], seccomp_profiles: dict[str, str]
) -> None:
    spec, payload = sshfs_pod(
        kube_node,
        sshd,
        "sshfs-ours",
        {"type": "Localhost", "localhostProfile": seccomp_profiles["sshfs"]},
    )
    with pods(kube_node, **{"sshfs-ours": spec}) as runs:
        run = runs["sshfs-ours"]
        run.expect("Succeeded")
        log = run.log()
        assert "MOUNTED " in log, f"expected a mount at /mnt/remote in the pod\n{run.report()}"
        assert "fuse.sshfs" in log, f"expected a fuse.sshfs mount in the pod\n{run.report()}"
        assert "Seccomp:\t2" in log, (
            f"expected the container to run under a seccomp filter\n{run.report()}"
        )
        got = (sshd["export"] / "sshfs-ours.txt").read_text().strip()
        assert got == payload, f"expected the server to receive {payload!r}, it has {got!r}"
        sessions = [
            ln for ln in nodemod.read_log(sshd["log"]).splitlines() if "subsystem 'sftp'" in ln
        ]
        evidence("sshfs-profile",
            [ln for ln in log.splitlines() if ln.startswith(("MOUNTED", "Seccomp"))]
            + [
                f"server side {sshd['export']}/sshfs-ours.txt = {got!r}",
                *sessions[-1:],
                *kubelet_lines(run.since, r"sshfs-ours.*ContainerDied")[-1:],
            ],
        )


def test_runtime_default_seccomp(
    kube_node: Any, sshd: dict[str, Any], seccomp_profiles: dict[str, str]
) -> None:
    """Negative controls for scenario 3, each reported by the kubelet.

    Measured on this stack: containerd 1.6's RuntimeDefault profile is capability-aware —
    with CAP_SYS_ADMIN granted it allows mount/umount2 (like Docker's default), so the pod of
    scenario 3 with RuntimeDefault *does* mount.  The documented error
    `fusermount3: mount failed: Operation not permitted` comes from (a) the runtime's default
    allow-list without our additions (our profile minus mount/umount2, as a Localhost profile),
    and (b) RuntimeDefault without CAP_SYS_ADMIN.  On AppArmor nodes the runtime's AppArmor
    profile (`deny mount`) is what stops RuntimeDefault pods; this kernel has no AppArmor.
    """
    err = "fusermount3: mount failed: Operation not permitted"
    specs = {
        "rtdefault-sysadmin": sshfs_pod(
            kube_node, sshd, "rtdefault-sysadmin", {"type": "RuntimeDefault"}
        ),
        "allowlist-no-mount": sshfs_pod(
            kube_node,
            sshd,
            "allowlist-no-mount",
            {"type": "Localhost", "localhostProfile": seccomp_profiles["without_mount"]},
        ),
        "rtdefault-nocap": sshfs_pod(
            kube_node, sshd, "rtdefault-nocap", {"type": "RuntimeDefault"}, sys_admin=False
        ),
    }
    with pods(kube_node, **{k: v[0] for k, v in specs.items()}) as runs:
        for name in ["allowlist-no-mount", "rtdefault-nocap"]:
            run = runs[name]
            run.expect("Failed")
            assert err in run.log(), (
                f"expected {err!r} in the container log of {name}\n{run.report()}"
            )
            assert not (sshd["export"] / f"{name}.txt").exists(), (
                f"{name} must not have written to the server"
            )
            term = run.pod["status"]["containerStatuses"][0]["state"]["terminated"]  # type: ignore[index]
            evidence("runtime-default",
                f"{name}: kubelet reports {run.phase} exitCode={term['exitCode']}; "
                f"container log: {err}",
            )
        run = runs["rtdefault-sysadmin"]
        run.expect("Succeeded")
        got = (sshd["export"] / "rtdefault-sysadmin.txt").read_text().strip()
        assert got == specs["rtdefault-sysadmin"][1]
        evidence("runtime-default",
            "rtdefault-sysadmin: RuntimeDefault + CAP_SYS_ADMIN mounts sshfs on containerd 1.6 "
            f"(its default seccomp allows mount for CAP_SYS_ADMIN): kubelet reports {run.phase}",
        )


def test_more_than_capacity_is_refused(kube_node: Any) -> None:
    want = SLOTS + 1
    with pods(kube_node, toomany=pod_spec(container(kube_node, "echo STARTED", fuse=want))) as runs:
        run = runs["toomany"]
        pod = run.expect("Failed")
        st = pod["status"]
        msg = st.get("message", "")
        assert st.get("reason") == "UnexpectedAdmissionError", (
            f"expected reason UnexpectedAdmissionError\n{run.report()}"
        )
        assert f"unavailable for {RESOURCE}. Requested: {want}, Available: {SLOTS}" in msg, (
            f"expected 'Requested: {want}, Available: {SLOTS}' for {RESOURCE} in the message\n"
            + run.report()
        )
        assert not st.get("containerStatuses"), f"expected no container started\n{run.report()}"
        uid = pod["metadata"]["uid"]
        started = kubelet_lines(
            run.since, re.escape(uid) + r".*(ContainerStarted|Need to start a new one)"
        )
        assert not started, "expected the kubelet not to start a sandbox:\n" + "\n".join(started)
        evidence("over-capacity",
                 f"toomany ({RESOURCE}: {want}): reason={st['reason']} message={msg!r}")


def plugin_running(node: Any) -> int:
    """Each test starts from a registered plugin, whatever ran before it."""
    if not node.pid("plugin"):
        since = nodemod.log_size(KUBELET_LOG)
        node.start_plugin(SLOTS)
        wait_registered(node, since, "before the test")
    return int(node.pid("plugin"))


def test_kubelet_restart_plugin_reregisters(kube_node: Any) -> None:
    plugin_pid = plugin_running(kube_node)
    assert plugin_pid, "the plugin is not running before the kubelet restart"
    sock = nodemod.DEVICE_PLUGIN_DIR / "kubelet.sock"
    before = sock.stat()
    since = nodemod.log_size(KUBELET_LOG)
    kube_node.restart_kubelet()
    after = sock.stat()
    lines = wait_registered(kube_node, since, "after the kubelet restart")
    assert kube_node.pid("plugin") == plugin_pid, (
        "the plugin process changed across the kubelet restart"
    )
    with pods(
        kube_node, afterrestart=pod_spec(container(kube_node, "ls -l /dev/fuse", fuse=1))
    ) as runs:
        run = runs["afterrestart"]
        run.expect("Succeeded")
        assert "/dev/fuse" in run.log(), f"expected /dev/fuse in the pod\n{run.report()}"
        cap = kubelet_lines(run.since, CAPACITY)
        assert cap, (f"expected 'Updated capacity for device plugin' {RESOURCE} after the "
                     f"restart\n{run.report()}")
        assert cap[-1].endswith(f"capacity={SLOTS}"), (
            f"expected capacity {SLOTS} after the restart, the kubelet logged: {cap}"
        )
        evidence("kubelet-restart",
            [
                f"kubelet restarted (kubelet.sock inode {before.st_ino} -> {after.st_ino}, "
                f"ctime {before.st_ctime:.3f} -> {after.st_ctime:.3f}); "
                f"plugin pid {plugin_pid} unchanged",
                *lines,
                cap[-1],
                f"new fuse pod after restart -> {run.phase}",
            ],
        )


def test_plugin_sigkill_and_restart(kube_node: Any) -> None:
    plugin_running(kube_node)
    sock = nodemod.DEVICE_PLUGIN_DIR / "github.com_fuse.sock"
    since = nodemod.log_size(KUBELET_LOG)
    kube_node.stop("plugin", sig=signal.SIGKILL)
    # The kubelet sees the plugin gone.
    gone = nodemod.wait_for(
        lambda: kubelet_lines(since, ENDED),
        30,
        "the kubelet to notice the killed plugin",
        detail=lambda: nodemod.tail(KUBELET_LOG),
    )
    stale = sock.exists()
    refused = False
    if stale:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(sock))
            except ConnectionRefusedError:
                refused = True
    assert stale, f"expected SIGKILL to leave the plugin's socket {sock} behind"
    assert refused, f"expected the stale socket {sock} to refuse connections"
    since = nodemod.log_size(KUBELET_LOG)
    kube_node.start_plugin(SLOTS)
    lines = wait_registered(kube_node, since, "after the plugin restart")

    def serving() -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            return True

    nodemod.wait_for(serving, 10, f"the restarted plugin to accept on {sock}")
    with pods(
        kube_node, afterkill=pod_spec(container(kube_node, "ls -l /dev/fuse", fuse=1))
    ) as runs:
        run = runs["afterkill"]
        run.expect("Succeeded")
        evidence("plugin-sigkill",
            [
                gone[0],
                f"stale socket {sock} left by SIGKILL refused connections; plugin restarted",
                *lines,
                f"new fuse pod after the plugin restart -> {run.phase}",
            ],
        )
