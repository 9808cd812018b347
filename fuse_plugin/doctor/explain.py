"""FUSE error messages, what causes them, how to tell the causes apart, and the fix.

This table is the one place the project keeps this knowledge: ``doctor --explain`` answers
from it and the docs render it (``markdown()``), so the two can never disagree. Entries
are ordered from the most specific message to the most generic errno; ``explain`` stops
after the first entry marked ``final``, so "failed to open /dev/fuse: Permission denied"
is explained as an open failure and not also as an AppArmor mount denial.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cause:
    cause: str
    tell: str  # how to tell this cause from the entry's other causes
    fix: str
    # The errno text this cause answers: a message naming another errno skips it, one
    # naming none gets every cause. Lets "failed to open /dev/fuse: <errno>" be exact.
    when: str = ""


@dataclass(frozen=True)
class KnownError:
    key: str
    example: str  # a real message of this kind: shown in the docs, checked by the tests
    errno: str
    patterns: tuple[str, ...]
    meaning: str
    causes: tuple[Cause, ...]
    final: bool = True
    _compiled: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = tuple(re.compile(p, re.IGNORECASE) for p in self.patterns)
        object.__setattr__(self, "_compiled", compiled)

    def matches(self, message: str) -> bool:
        return any(p.search(message) for p in self._compiled)

    def causes_for(self, message: str) -> tuple[Cause, ...]:
        """The causes for the errno the message names; all of them when it names none."""
        if not any(re.search(e, message, re.IGNORECASE) for e in _ERRNOS):
            return self.causes
        return tuple(c for c in self.causes
                     if not c.when or re.search(c.when, message, re.IGNORECASE))


_ENOENT = r"no such file|\bENOENT\b"
_EPERM = r"not permitted|\bEPERM\b"
_EACCES = r"permission denied|\bEACCES\b"
_ECONNREFUSED = r"connection refused|\bECONNREFUSED\b"
_ERRNOS = (_ENOENT, _EPERM, _EACCES, _ECONNREFUSED)
_ERRNO_TEXT = {_ENOENT: ("No such file or directory", "ENOENT"),
               _EPERM: ("Operation not permitted", "EPERM"),
               _EACCES: ("Permission denied", "EACCES"),
               _ECONNREFUSED: ("Connection refused", "ECONNREFUSED")}

_RESOURCE_FIX = ("request the device: `resources.limits: {github.com/fuse: 1}`; if the node "
                 "has no github.com/fuse capacity (`kubectl describe node`), run "
                 "`fuse-device-plugin doctor` on that node")

ERRORS: tuple[KnownError, ...] = (
    # What the cluster says about a FUSE pod before any FUSE call: the kubelet, the API
    # server's admission and the runtime, as the pod's events and status show them.
    KnownError(
        key="apparmor-not-enabled",
        example="Pod was rejected: Cannot enforce AppArmor: AppArmor is not enabled on the "
                "host",
        errno="",
        patterns=(r"cannot enforce apparmor",),
        meaning="the kubelet refused a pod that asks for an AppArmor profile (Kubernetes "
                "1.30+) on a node without AppArmor",
        causes=(
            Cause("the pod's `appArmorProfile` (the default-mode examples name "
                  "fuse-device-plugin-<preset>) on a node whose kernel has no AppArmor",
                  "`kubectl get pod` shows `Failed`, reason `AppArmor`; on the node, "
                  "`cat /sys/module/apparmor/parameters/enabled` is not `Y`",
                  "remove `appArmorProfile` on such nodes (the seccomp profile and the "
                  "single device remain), or run the pod on AppArmor nodes"),
        )),
    KnownError(
        key="pod-security-sys-admin",
        example='pods "sshfs-example" is forbidden: violates PodSecurity "baseline:latest": '
                'non-default capabilities (container "sshfs" must not include "SYS_ADMIN" in '
                "securityContext.capabilities.add)",
        errno="",
        patterns=(r'violates PodSecurity "(baseline|restricted)[^"]*":.*SYS_ADMIN',),
        meaning="Pod Security admission refused a default-mode FUSE pod",
        causes=(
            Cause("default mode adds CAP_SYS_ADMIN, which `baseline` and `restricted` forbid, "
                  "also in a `hostUsers: false` pod",
                  "the namespace's label `pod-security.kubernetes.io/enforce` is `baseline` "
                  "or `restricted`",
                  "use broker mode (the pod needs only `github.com/fuse: 1`), or a namespace "
                  "at `privileged`"),
        )),
    KnownError(
        key="cdi-unresolvable",
        example="CDI device injection failed: unresolvable CDI devices github.com/fuse=fuse",
        errno="",
        patterns=(r"unresolvable CDI devices .*fuse",),
        meaning="the runtime found no CDI spec for the device the plugin named",
        causes=(
            Cause("the plugin runs with `--cdi` (the `cdi` component) but its spec is not in "
                  "a directory the runtime reads, or was removed",
                  "on the node, `grep -l github.com/fuse /var/run/cdi/*.json /etc/cdi/*.json`; "
                  "the runtime's CDI directories (containerd: `cdi_spec_dirs`)",
                  "mount the runtime's CDI directory into the plugin at `--cdi-dir` (the "
                  "component mounts /var/run/cdi), or restart the plugin pod to write it again"),
        )),
    # Broker mode's shim (fuse_plugin/broker/native/fusermount3.c) and the broker's
    # refusals, as the pod's FUSE program prints them (docs/broker.md).
    KnownError(
        key="broker-restarting",
        example="fusermount3: the FUSE mount broker at /run/fuse-broker/broker.sock is not "
                "answering (...); waiting up to 30 s for it to restart",
        errno="",
        patterns=(r"FUSE mount broker at \S+ is not answering",),
        meaning="broker mode's shim is waiting for the node's broker",
        causes=(
            Cause("the broker on this node is restarting (a rollout, a crash): its socket is "
                  "missing or stale, or (`it is stopping`) the old broker, draining, did "
                  "nothing of this request",
                  "the parenthesis says which: `it is stopping` for a draining broker",
                  "nothing: the mount goes on once the broker is back; otherwise `fusermount3: "
                  "cannot reach the FUSE mount broker ...` follows once the wait is over"),
        )),
    KnownError(
        key="broker-unreachable",
        example="fusermount3: cannot reach the FUSE mount broker at "
                "/run/fuse-broker/broker.sock: Connection refused",
        errno="",
        patterns=(r"cannot reach the FUSE mount broker",),
        meaning="broker mode's shim found no broker to ask",
        causes=(
            Cause("the broker has been down for longer than the wait",
                  "the line comes after `... is not answering (...); waiting up to 30 s for "
                  "it to restart` (`Connection refused`, or `No such file or directory`)",
                  "check `kubectl -n fuse-device-plugin get pods -l "
                  "app.kubernetes.io/name=fuse-mount-broker -o wide`; its log says why it "
                  "stopped; `FUSE_BROKER_WAIT=<seconds>` in the pod's environment waits longer"),
            Cause("the container has no `/run/fuse-broker`: it was not given broker mode's "
                  "binds",
                  "`No such file or directory` at once, alone (no waiting line before it)",
                  "request `github.com/fuse: 1` with the plugin in broker mode; deploy "
                  "`manifests/broker/`", when=_ENOENT),
        )),
    KnownError(
        key="broker-stopping",
        example="fusermount3: broker refused: the broker is stopping and did nothing of this "
                "request; try again",
        errno="",
        patterns=(r"broker is stopping and did nothing",),
        meaning="a draining broker refused a request it had not acted on",
        causes=(
            Cause("a draining broker did nothing of the request, and the shim did not wait for "
                  "the next one (`FUSE_BROKER_WAIT=0`), or an older shim (one that ignores "
                  "`retry=1`) asked",
                  "`FUSE_BROKER_WAIT=0` in the pod's environment, or a container started with "
                  "an older release's shim",
                  "run the mount again; remove `FUSE_BROKER_WAIT=0`"),
        )),
    KnownError(
        key="broker-closed",
        example="fusermount3: the FUSE mount broker closed the connection (restarting?)",
        errno="",
        patterns=(r"FUSE mount broker closed the connection",),
        meaning="the broker went away after it had read the request",
        causes=(
            Cause("the broker died after reading the request: it may have acted on it, so the "
                  "shim does not ask again",
                  "the broker's pod on the node restarted (`kubectl -n fuse-device-plugin get "
                  "pods -l app.kubernetes.io/name=fuse-mount-broker -o wide`)",
                  "run the mount again once the broker is back; `fusermount3 -u` a dead mount "
                  "it may have left"),
        )),
    KnownError(
        key="broker-not-given",
        example="fusermount3: broker refused: this container was not given broker mode by the "
                "device plugin (no /run/fuse-broker bind of the broker's directory in its mount "
                "namespace); request github.com/fuse in its own resources",
        errno="",
        patterns=(r"not given broker mode",),
        meaning="the broker refused a caller the device plugin did not give broker mode",
        causes=(
            Cause("the request came from a container without `github.com/fuse` (a sibling "
                  "sharing the pod's PID namespace) or from outside a container",
                  "the container's own `resources` lack `github.com/fuse`",
                  "request `github.com/fuse: 1` in that container's own resources"),
        )),
    KnownError(
        key="broker-deadline",
        example="fusermount3: broker: the request did not finish within 5s (a FUSE filesystem "
                "on the way may not be answering)",
        errno="",
        patterns=(r"did not finish within \d+s",),
        meaning="the broker killed the request's helper at its deadline",
        causes=(
            Cause("a FUSE filesystem the path leads through did not answer; the broker killed "
                  "its helper",
                  "the broker's log has a `broker.stalled` line for the container",
                  "check the FUSE daemons the container runs; the broker's log names the "
                  "request"),
        )),
    KnownError(
        key="lxcfs-waiting",
        example="fusermount3: broker refused: no lxcfs serves on this node (deploy "
                "manifests/broker/lxcfs-daemonset.yaml; it may be starting); waiting up to "
                "30 s for it",
        errno="",
        patterns=(r"no lxcfs serves on this node",),
        meaning="an LXCFS views pod (`fusermount3 --lxcfs --`) is waiting for the node's lxcfs",
        causes=(
            Cause("the pod started before lxcfs, or while lxcfs restarts (docs/broker.md, "
                  "\"LXCFS views\")",
                  "the node's `fuse-lxcfs` pod is missing or not Ready (`kubectl -n "
                  "fuse-device-plugin get pods -l app.kubernetes.io/name=fuse-lxcfs -o wide`)",
                  "nothing while lxcfs starts: the shim asks again every half second for up to "
                  "`FUSE_BROKER_WAIT` (30 s), then exits 1 without running the command and the "
                  "kubelet restarts the container; without the lxcfs DaemonSet, deploy the "
                  "broker component's `manifests/broker/lxcfs-daemonset.yaml`"),
        )),
    KnownError(
        key="broker-refused",
        example="fusermount3: broker refused: mount option 'suid' refused: broker mounts are "
                "always nosuid,nodev",
        errno="",
        patterns=(r"broker refused:",),
        meaning="the broker refused the request by one of its rules (docs/security.md, "
                "\"The rules\")",
        causes=(
            Cause("the request broke a broker rule (the reason names it)",
                  "the broker's log has the same line (`broker.refused`, with its `kind`)",
                  "change the mountpoint or options"),
        )),
    # Profiles the pod names but the node lacks (docs/profiles.md).
    KnownError(
        key="apparmor-profile-not-loaded",
        example="apparmor profile not found fuse-device-plugin-sshfs",
        errno="",
        patterns=(r"apparmor profile not found", r"profile .* is not loaded"),
        meaning="the runtime could not apply the AppArmor profile the pod names "
                "(CreateContainerError)",
        causes=(
            Cause("the profile is not loaded on this node",
                  "`fuse-device-plugin doctor` on the node: the `apparmor profiles` line",
                  "run `install-profiles` on the node and check its `profile_rejected` lines"),
        )),
    KnownError(
        key="seccomp-profile-missing",
        example='cannot load seccomp profile "/var/lib/kubelet/seccomp/fuse-device-plugin/'
                'sshfs.json": ... no such file or directory',
        errno="",
        patterns=(r"cannot load seccomp profile",),
        meaning="the kubelet could not read the seccomp profile the pod names",
        causes=(
            Cause("the seccomp file is not on this node",
                  "`fuse-device-plugin doctor` on the node: the `seccomp profiles` line",
                  "run `install-profiles` (or copy the file) on the node"),
        )),
    KnownError(
        key="open-dev-fuse",
        example="fuse: failed to open /dev/fuse: Permission denied",
        errno="ENOENT / EPERM / EACCES",
        patterns=(r"failed to open /dev/fuse", r"open(ing)?\(?\s*\"?/dev/fuse",
                  r"/dev/fuse:\s*(no such|operation not|permission)"),
        meaning="opening /dev/fuse failed, before any mount was tried; the errno says why",
        causes=(
            Cause("the container has no /dev/fuse",
                  "`ls -l /dev/fuse` in the container: No such file or directory",
                  _RESOURCE_FIX, when=_ENOENT),
            Cause("the device cgroup does not allow c 10:229: the node came from a hostPath "
                  "volume (or a `/dev` bind mount without the resource), which gives the file "
                  "but not the permission to open it",
                  "the node exists in the container yet `exec 3<>/dev/fuse` fails with "
                  "Operation not permitted",
                  "drop the hostPath volume and request `github.com/fuse: 1` instead: the "
                  "plugin's allocation adds the cgroup rule", when=_EPERM),
            Cause("/dev/fuse is mode 0600 (owned by host root) and the process is not host "
                  "root: a non-root user, or any user in a user-namespaced pod "
                  "(`hostUsers: false`); in broker mode the shim says it "
                  "(`fusermount3: failed to open /dev/fuse`)",
                  "`ls -l /dev/fuse` in the container shows crw-------",
                  "make the node's /dev/fuse 0666 (udev rule `KERNEL==\"fuse\", MODE=\"0666\"`, "
                  "the default on most distributions); `doctor` warns on 0600", when=_EACCES),
        )),
    KnownError(
        key="device-not-found",
        example="fuse: device not found, try 'modprobe fuse' first",
        errno="ENODEV",
        patterns=(r"fuse: device not found", r"\bENODEV\b", r"no such device",
                  r"unknown filesystem type '?fuse"),
        meaning="no usable FUSE device: in the container, or in the node's kernel",
        causes=(
            Cause("the container has no /dev/fuse: the pod did not request github.com/fuse, "
                  "or the plugin is not registered on this node",
                  "`ls -l /dev/fuse` in the container fails; the node shows no github.com/fuse "
                  "capacity when the plugin is the problem",
                  _RESOURCE_FIX),
            Cause("the node's kernel has no FUSE filesystem (the plugin then reports the "
                  "device unhealthy)",
                  "`grep fuse /proc/filesystems` on the node prints nothing",
                  "`modprobe fuse` on the node and add `fuse` to /etc/modules-load.d/fuse.conf"),
        )),
    KnownError(
        key="not-connected",
        example="ls: cannot access '/mnt/data': Transport endpoint is not connected",
        errno="ENOTCONN",
        patterns=(r"transport endpoint is not connected", r"\bENOTCONN\b"),
        meaning="the mount is still there but the FUSE daemon that served it is gone",
        causes=(
            Cause("the FUSE daemon exited (crash, OOM kill, container restart) and left its "
                  "mount behind",
                  "`grep fuse /proc/self/mountinfo` still lists the mountpoint while no daemon "
                  "process serves it",
                  "unmount it (`fusermount3 -u -z MOUNTPOINT`, or `umount -l` on the node for a "
                  "propagated mount) and start the daemon again; a liveness probe that stats "
                  "the mountpoint makes the kubelet do this"),
            Cause("lxcfs restarted (node reboot, DaemonSet update): pods that bind-mounted "
                  "/proc files from the old lxcfs mount keep the dead mount",
                  "the error comes from /proc files in application pods, e.g. "
                  "`top: failed /proc/stat open`",
                  "restart the affected pods once lxcfs is back; see the lxcfs preset's "
                  "node-restart failure mode in docs/profiles.md; in broker mode, LXCFS "
                  "views heal this themselves (docs/broker.md#lxcfs-views)"),
        )),
    KnownError(
        key="allow-other",
        example=("fusermount3: option allow_other only allowed if 'user_allow_other' is set "
                 "in /etc/fuse.conf"),
        errno="",
        patterns=(r"user_allow_other",),
        meaning="a non-root user asked fusermount3 for -o allow_other",
        causes=(
            Cause("fusermount3 allows allow_other for non-root users only when the image's "
                  "/etc/fuse.conf says so",
                  "the daemon runs as a non-root user with -o allow_other",
                  "add the line `user_allow_other` to /etc/fuse.conf in the image, or drop "
                  "allow_other, or mount as root"),
        )),
    KnownError(
        key="fusermount3",
        example="fusermount3: mount failed: Operation not permitted",
        errno="",
        patterns=(r"fusermount3?: mount failed",),
        meaning="the setuid-root helper that non-root FUSE daemons use called mount(2) and "
                "the kernel refused; the errno after the colon names the cause",
        causes=(
            Cause("the setuid bit did nothing: `allowPrivilegeEscalation: false` sets "
                  "no_new_privs, so fusermount3 runs without CAP_SYS_ADMIN",
                  "`grep NoNewPrivs /proc/self/status` in the container prints 1",
                  "set `allowPrivilegeEscalation: true` on the FUSE container, or mount as "
                  "root", when=_EPERM),
            Cause("in broker mode, the image's real helper is speaking: the plugin is not in "
                  "broker mode, or the program runs a helper of its own name that the shim "
                  "does not cover (docs/broker.md, \"How FUSE programs reach their helper\")",
                  "`ls /run/fuse-broker` in the container fails (no broker mode), or the "
                  "program's helper is not at a path the shim is bound to",
                  "deploy `manifests/broker/`; for another helper name, bind the shim there",
                  when=_EPERM),
        ),
        final=False),
    KnownError(
        key="eperm",
        example="fuse: mount failed: Operation not permitted",
        errno="EPERM",
        patterns=(r"operation not permitted", r"\bEPERM\b"),
        meaning="the kernel refused the mount (or the open of /dev/fuse) outright; three "
                "causes, told apart in this order",
        causes=(
            Cause("the device cgroup does not allow c 10:229 (a hostPath /dev/fuse instead of "
                  "the plugin's allocation)",
                  "`exec 3<>/dev/fuse` in the container already fails with Operation not "
                  "permitted: it is not the mount at all",
                  "drop the hostPath volume and request `github.com/fuse: 1`"),
            Cause("no CAP_SYS_ADMIN in the mounting process (not added, or dropped with "
                  "`drop: [ALL]`)",
                  "opening /dev/fuse works, but `grep CapEff /proc/self/status` lacks bit 21 "
                  "(`capsh --decode=<value>` shows no cap_sys_admin)",
                  "`securityContext.capabilities.add: [SYS_ADMIN]` (Pod Security `baseline` "
                  "forbids it: the namespace needs `privileged`); non-root daemons also need "
                  "`allowPrivilegeEscalation: true` for fusermount3"),
            Cause("the seccomp profile lacks mount/umount2: a Localhost profile without them "
                  "(one copied from Docker's default loses its CAP_SYS_ADMIN conditions "
                  "under containerd), or RuntimeDefault on a runtime that does not widen it "
                  "for SYS_ADMIN (containerd 1.6 does, and then AppArmor decides)",
                  "/dev/fuse opens and CapEff has SYS_ADMIN, yet mount fails; `grep Seccomp "
                  "/proc/self/status` prints 2",
                  "`seccompProfile: {type: Localhost, localhostProfile: "
                  "fuse-device-plugin/<preset>.json}`; `doctor` checks it is on the node"),
        )),
    KnownError(
        key="unmount-denied",
        example="fusermount3: failed to unmount /mnt/x: Permission denied",
        errno="EACCES",
        patterns=(r"failed to unmount .*(permission denied|\bEACCES\b)",),
        meaning="AppArmor refused an unmount",
        causes=(
            Cause("AppArmor: unmount outside the profile's `--mountpoint`, or under `/proc`, "
                  "`/sys`, `/dev`",
                  "the node's kernel log has an `apparmor=\"DENIED\"` line naming the path",
                  "mount and unmount inside the glob"),
        )),
    KnownError(
        key="eacces",
        example="fuse: mount failed: Permission denied",
        errno="EACCES",
        patterns=(r"permission denied", r"\bEACCES\b"),
        meaning="a security policy or the device node's mode denied access",
        causes=(
            Cause("the runtime's default AppArmor profile ends in `deny mount`, which beats "
                  "any capability",
                  "`cat /proc/self/attr/current` in the container names the runtime default "
                  "(cri-containerd.apparmor.d, docker-default); the node's kernel log has "
                  "`apparmor=\"DENIED\" operation=\"mount\"`",
                  "`appArmorProfile: {type: Localhost, localhostProfile: "
                  "fuse-device-plugin-<preset>}` (installed by `install-profiles`; `doctor` "
                  "shows it loaded), not Unconfined"),
            Cause("/dev/fuse is mode 0600 and the process is not host root (non-root user, or "
                  "a user-namespaced pod)",
                  "`ls -l /dev/fuse` in the container shows crw-------",
                  "make the node's /dev/fuse 0666 (udev rule `KERNEL==\"fuse\", MODE=\"0666\"`)"),
            Cause("our profile refused it: a mountpoint outside the profile's `--mountpoint`, "
                  "a filesystem type of another preset, or flags outside the allowed set "
                  "(`suid`, `dev`, `sync`, ...)",
                  "the node's kernel log says `apparmor=\"DENIED\" operation=\"mount\"` with "
                  "`fstype`, `flags` and `name`, and `cat /proc/self/attr/current` names "
                  "fuse-device-plugin-<preset>",
                  "regenerate the profile with a matching `--mountpoint` or preset; drop the "
                  "extra `-o` flags"),
            Cause("broker mode on an AppArmor node and no seccomp profile: AppArmor refused "
                  "`mount(2)` with EACCES, so libfuse never ran the shim",
                  "the pod adds no capability and `grep Seccomp /proc/self/status` in the "
                  "container prints 0",
                  "`seccompProfile: {type: RuntimeDefault}` on the pod"),
        )),
)


def explain(message: str) -> list[KnownError]:
    """The entries that explain ``message``, most specific first; empty when none does."""
    found: list[KnownError] = []
    for entry in ERRORS:
        if entry.matches(message):
            found.append(entry)
            if entry.final:
                break
    return found


def markdown() -> str:
    """The table as Markdown, for docs that must say the same as ``doctor --explain``."""
    rows = ["| Message | errno | Cause | How to tell | Fix |", "|---|---|---|---|---|"]
    for entry in ERRORS:
        for cause in entry.causes:
            example = entry.example
            if cause.when:  # show the message with the errno text this cause answers
                example = example.rsplit(": ", 1)[0] + ": " + _ERRNO_TEXT[cause.when][0]
            errno = _ERRNO_TEXT[cause.when][1] if cause.when else entry.errno or "-"
            cells = [f"`{example}`", errno, cause.cause, cause.tell, cause.fix]
            rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
