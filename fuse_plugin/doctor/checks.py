"""``fuse-device-plugin doctor``: is this node ready for FUSE pods, and if not, why.

Each check reads one thing on the node and returns one line: a verdict (ok, warn, fail),
a detail and a fix. Every node path is read under ``root``, so the same code checks a
node from the host (root ``/``), from a pod that mounts the node's ``/`` at ``/host``,
and, in the tests, a fake node tree in a temp dir. Any ``fail`` makes the exit code 1;
a ``warn`` is something that breaks only some workloads (e.g. a 0600 device node).

``--explain MESSAGE`` answers from ``explain.ERRORS`` instead of looking at the node.
"""

from __future__ import annotations

import argparse
import enum
import errno
import json
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from fuse_plugin import args, config, files, sockets
from fuse_plugin.devices import FUSE_MAJOR, FUSE_MINOR, examine
from fuse_plugin.errors import EXIT_USAGE, Failure
from fuse_plugin.profiles import install, lint, presets

# The presets, names and paths are the generator's own, so the doctor checks for exactly
# what `profile` generates and `install-profiles` installs.
PRESETS = tuple(presets.PRESETS)
DEFAULT_SECCOMP_DIR = presets.DEFAULT_SECCOMP_DIR
# The kubelet's dial-back and our own answer take milliseconds; two seconds only says
# "hung" rather than "slow".
PLUGIN_TIMEOUT = 2.0
CONNECT_TIMEOUT = 1.0
OUTPUTS = ("text", "json")


class Verdict(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


_RANK = {Verdict.OK: 0, Verdict.WARN: 1, Verdict.FAIL: 2}


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Node:
    """What to check and where; paths are as the node sees them, read under ``root``."""

    root: Path = Path("/")
    device_plugin_dir: Path = config.DEFAULT_DEVICE_PLUGIN_DIR
    fuse_device: Path = config.DEFAULT_FUSE_DEVICE
    resource_name: str = config.DEFAULT_RESOURCE_NAME
    # The plugin's --instance: its socket's name. Empty: whichever sockets of the resource
    # are there (the DaemonSet names each pod's by its UID).
    instance: str = ""
    seccomp_dir: Path = DEFAULT_SECCOMP_DIR
    presets: tuple[str, ...] = PRESETS
    # Presets the user named must be installed (fail); the default set only warns.
    strict_presets: bool = False

    def at(self, path: Path | str) -> Path:
        """Where this process reaches the node's ``path``."""
        return self.root / Path(path).relative_to("/")

    @property
    def socket_path(self) -> Path:
        settings = config.Settings(device_plugin_dir=self.device_plugin_dir,
                                   resource_name=self.resource_name, instance=self.instance)
        return settings.socket_path

    def plugin_sockets(self) -> list[Path]:
        """The plugin sockets to check: ours by --instance, else every socket named for
        the resource (``<resource>.sock`` and ``<resource>-<instance>.sock``)."""
        if self.instance:
            return [self.socket_path]
        pattern = config.sibling_socket(self.resource_name)
        try:
            names = sorted(e.name for e in self.at(self.device_plugin_dir).iterdir())
        except OSError:
            names = []
        return [self.device_plugin_dir / n for n in names if pattern.fullmatch(n)]

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / config.KUBELET_SOCKET


# -- reading node files --------------------------------------------------------------

class CannotRead(Exception):
    """A node file the doctor cannot use; the message is a short reason."""


def read_text(real: Path) -> str:
    """A node file's text, read the careful way: the node may hold anything at a path.

    A FIFO, /dev/zero or a huge file where a small file belongs must give a finding, not
    a hang or an endless read (files.read_regular refuses anything but a regular file,
    without opening it). FileNotFoundError passes through: missing is often its own
    verdict; every other problem is CannotRead.
    """
    try:
        data = files.read_regular(real)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise CannotRead(err.strerror or str(err)) from None
    except files.NotReadable as err:
        raise CannotRead(str(err)) from None
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise CannotRead(f"not UTF-8 text (byte {err.start})") from None


def _why(err: Exception) -> str:
    return (err.strerror or str(err)) if isinstance(err, OSError) else str(err)


# -- the checks ----------------------------------------------------------------------

def check_fuse_filesystem(node: Node) -> Check:
    name, path = "fuse filesystem", "/proc/filesystems"
    try:
        text = read_text(node.at(path))
    except (OSError, CannotRead) as err:
        return Check(name, Verdict.FAIL, f"cannot read {path}: {_why(err)}",
                     "run the doctor where /proc is the node's (or mount it under --root)")
    if "fuse" in {line.split()[-1] for line in text.splitlines() if line.split()}:
        return Check(name, Verdict.OK, f"fuse is in {path}")
    return Check(name, Verdict.FAIL, f"the kernel has no fuse filesystem (not in {path})",
                 "modprobe fuse; make it stick with `fuse` in /etc/modules-load.d/fuse.conf")


def check_device(node: Node) -> list[Check]:
    """The node itself (char 10:229, as the plugin's health reads it), then its mode:
    0600 locks out non-root openers."""
    name, shown = "fuse device", node.fuse_device
    recreate = f"mknod -m 0666 {shown} c {FUSE_MAJOR} {FUSE_MINOR} (or modprobe fuse)"
    found = examine(node.at(shown), Path(shown))
    if found.missing:
        return [Check(name, Verdict.FAIL, found.problem, recreate)]
    if found.unreadable:
        return [Check(name, Verdict.FAIL, found.problem, "run the doctor as root")]
    if found.problem:
        return [Check(name, Verdict.FAIL, found.problem, f"remove it, then {recreate}")]
    checks = [Check(name, Verdict.OK, f"{shown} is char {FUSE_MAJOR}:{FUSE_MINOR}")]
    if found.mode & 0o666 == 0o666:
        checks.append(Check("fuse device mode", Verdict.OK,
                            f"{found.mode:04o}: every user can open it"))
    else:
        checks.append(Check(
            "fuse device mode", Verdict.WARN,
            f"{found.mode:04o}: only its owner (uid {found.uid}) can open it; non-root "
            "fusermount3, non-root and user-namespaced pods (hostUsers: false) get "
            "Permission denied",
            f"chmod 0666 {shown}; keep it with a udev rule: KERNEL==\"fuse\", MODE=\"0666\""))
    return checks


def check_plugin_dir(node: Node) -> Check:
    name, shown = "device-plugin dir", node.device_plugin_dir
    real = node.at(shown)
    if real.is_dir():
        return Check(name, Verdict.OK, f"{shown} exists")
    if real.exists():
        return Check(name, Verdict.FAIL, f"{shown} is not a directory",
                     "pass the kubelet's device-plugin dir with --device-plugin-dir")
    return Check(name, Verdict.FAIL, f"{shown} does not exist",
                 "is the kubelet running (it creates the dir)? is --device-plugin-dir right? "
                 "in a pod, mount the dir as a hostPath volume")


def _socket_file_problem(name: str, real: Path, shown: Path, whose: str,
                         restart: str) -> Check | None:
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return Check(name, Verdict.FAIL, f"{shown} does not exist: {whose} is not running",
                     restart)
    except OSError as err:
        return Check(name, Verdict.FAIL, f"{shown}: {err.strerror}", "run the doctor as root")
    if not stat.S_ISSOCK(st.st_mode):
        return Check(name, Verdict.FAIL, f"{shown} is not a socket", restart)
    return None


def _socket_problem(name: str, node: Node, shown: Path, whose: str,
                    restart: str) -> Check | None:
    """A failing line when the socket is missing, not a socket, or refuses; else None."""
    real = node.at(shown)
    problem = _socket_file_problem(name, real, shown, whose, restart)
    if problem is not None:
        return problem
    refused = sockets.refusal(real, timeout=CONNECT_TIMEOUT)
    if refused is None:
        return None
    if refused.errno == errno.ECONNREFUSED:
        return Check(name, Verdict.FAIL,
                     f"{shown} refuses connections: a stale socket, {whose} died", restart)
    if refused.errno == errno.EACCES:
        return Check(name, Verdict.WARN, f"{shown}: permission denied", "run the doctor as root")
    return Check(name, Verdict.FAIL, f"{shown}: cannot connect: {refused.strerror or refused}",
                 restart)


def check_kubelet_socket(node: Node) -> Check:
    name, shown = "kubelet socket", node.kubelet_socket
    problem = _socket_problem(name, node, shown, "the kubelet",
                              "start or restart the kubelet (systemctl status kubelet)")
    return problem or Check(name, Verdict.OK, f"{shown} accepts connections")


_PLUGIN_RESTART = ("check the fuse-device-plugin DaemonSet pod on this node: "
                   "kubectl get pods -o wide, then its logs")


def check_plugin_socket(node: Node, timeout: float = PLUGIN_TIMEOUT) -> Check:
    """The plugin's socket answers a real GetDevicePluginOptions, as the kubelet's first
    call does. Without --instance every socket of the resource is checked: during a
    rollout two plugin pods serve, and one killed with SIGKILL leaves a stale one."""
    found = node.plugin_sockets()
    if not found:
        shown = node.socket_path.with_name(f"{config.socket_base(node.resource_name)}"
                                           "[-<instance>].sock")
        return Check("plugin socket", Verdict.FAIL,
                     f"{shown} does not exist: the plugin is not running", _PLUGIN_RESTART)
    checks = [_check_plugin_socket(node, path, timeout) for path in found]
    if len(checks) == 1:
        return checks[0]
    good = [c.detail for c in checks if c.verdict is Verdict.OK]
    bad = [c for c in checks if c.verdict is not Verdict.OK]
    if not bad:
        return Check("plugin socket", Verdict.OK,
                     f"{len(good)} plugins serve (a rollout: the kubelet uses the newest): "
                     + "; ".join(good))
    worst = max((c.verdict for c in bad), key=_RANK.__getitem__)
    verdict = Verdict.WARN if good else worst
    fix = ("a socket left by an earlier plugin pod: the plugin removes stale ones when it "
           "starts; else remove it by hand" if good else bad[0].fix)
    return Check("plugin socket", verdict, "; ".join([*good, *(c.detail for c in bad)]), fix)


def _check_plugin_socket(node: Node, shown: Path, timeout: float) -> Check:
    name, restart = "plugin socket", _PLUGIN_RESTART
    problem = _socket_problem(name, node, shown, "the plugin", restart)
    if problem is not None:
        return problem
    import grpc

    from fuse_plugin.api import api_pb2 as api
    from fuse_plugin.api import api_pb2_grpc

    with sockets.dialable(node.at(shown)) as target, \
            grpc.insecure_channel(f"unix:{target}") as channel:
        try:
            options = api_pb2_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                api.Empty(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as err:
            return Check(name, Verdict.FAIL,
                         f"{shown} accepts connections but GetDevicePluginOptions failed: "
                         f"{err.code().name}", restart)
    preferred = "yes" if options.get_preferred_allocation_available else "no"
    return Check(name, Verdict.OK,
                 f"{shown} answers GetDevicePluginOptions (preferred allocation: {preferred})")


def _aggregate(name: str, results: list[tuple[str, Verdict, str]], ok_detail: str,
               fix: str) -> Check:
    """One line for many presets: the worst verdict, naming only the presets not ok."""
    worst = max((verdict for _, verdict, _ in results), key=_RANK.__getitem__)
    good = [preset for preset, verdict, _ in results if verdict is Verdict.OK]
    if worst is Verdict.OK:
        return Check(name, Verdict.OK, f"{ok_detail}: {', '.join(good)}")
    by_note: dict[str, list[str]] = {}
    for preset, verdict, note in results:
        if verdict is not Verdict.OK:
            by_note.setdefault(note, []).append(preset)
    parts = [f"{note}: {', '.join(names)}" for note, names in by_note.items()]
    if good:
        parts.append(f"ok: {', '.join(good)}")
    return Check(name, worst, "; ".join(parts), fix)


def check_apparmor(node: Node) -> list[Check]:
    """Kernel AppArmor, then our profiles: the only layer that limits mounts to FUSE types."""
    name, path = "apparmor", "/sys/module/apparmor/parameters/enabled"
    without = ("expected on SELinux distributions; there only seccomp and capabilities limit "
               "FUSE pods, and they cannot restrict the filesystem type (docs/security.md)")
    try:
        enabled = read_text(node.at(path)).strip()
    except FileNotFoundError:
        return [Check(name, Verdict.WARN, f"the kernel has no AppArmor ({path} is missing)",
                      without)]
    except (OSError, CannotRead) as err:
        return [Check(name, Verdict.WARN, f"cannot read {path}: {_why(err)}", without)]
    if not install.apparmor_enabled(enabled):
        return [Check(name, Verdict.WARN, f"AppArmor is disabled in the kernel ({path}: "
                      f"{' '.join(enabled.split())[:20] or 'empty'})", without)]
    checks = [Check(name, Verdict.OK, "AppArmor is enabled in the kernel")]
    listing = "/sys/kernel/security/apparmor/profiles"
    try:
        text = read_text(node.at(listing))
    except FileNotFoundError:
        checks.append(Check("apparmor profiles", Verdict.WARN, f"{listing} is missing",
                            "mount -t securityfs securityfs /sys/kernel/security"))
        return checks
    except (OSError, CannotRead) as err:
        checks.append(Check("apparmor profiles", Verdict.WARN,
                            f"cannot read {listing}: {_why(err)}", "run the doctor as root"))
        return checks
    loaded = install.parse_loaded(text)
    missing = Verdict.FAIL if node.strict_presets else Verdict.WARN
    results: list[tuple[str, Verdict, str]] = []
    for preset in node.presets:
        mode = loaded.get(presets.apparmor_name(preset))
        if mode == "enforce":
            results.append((preset, Verdict.OK, ""))
        elif mode is None:
            results.append((preset, missing, "not loaded"))
        else:
            results.append((preset, Verdict.WARN, f"loaded in {mode} mode, not enforce"))
    checks.append(_aggregate(
        "apparmor profiles", results, "loaded in enforce mode",
        "fuse-device-plugin install-profiles --source DIR (loads them with apparmor_parser -r); "
        "--preset checks only the presets this node uses"))
    return checks


def _allows(profile: dict[str, Any], syscall: str) -> bool:
    """Whether a profile that passed lint.seccomp_shape allows ``syscall``."""
    if profile.get("defaultAction") == "SCMP_ACT_ALLOW":
        return True
    return any(rule["action"] == "SCMP_ACT_ALLOW" and syscall in rule["names"]
               for rule in profile.get("syscalls", []))


def _read_json(path: Path) -> Any:
    """The JSON in a node file; FileNotFoundError or CannotRead."""
    text = read_text(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise CannotRead("nested too deeply") from None
    except ValueError:
        raise CannotRead("not valid JSON") from None


def _seccomp_state(path: Path) -> tuple[Verdict | None, str]:
    """None when the file is missing; else a verdict on what the kubelet would load."""
    try:
        profile = _read_json(path)
    except FileNotFoundError:
        return None, "missing"
    except CannotRead as err:
        return Verdict.FAIL, f"unreadable ({err})"
    if not isinstance(profile, dict) or "defaultAction" not in profile:
        return Verdict.FAIL, "is not an OCI seccomp profile (no defaultAction)"
    shape = lint.seccomp_shape(profile)
    if shape:
        return Verdict.FAIL, f"is not an OCI seccomp profile ({shape[0]})"
    refused = [s for s in ("mount", "umount2") if not _allows(profile, s)]
    if refused:
        return Verdict.FAIL, f"does not allow {', '.join(refused)}"
    return Verdict.OK, ""


def check_seccomp(node: Node) -> Check:
    """Our Localhost profiles under the kubelet's seccomp root; a bad one blocks the pod."""
    missing = Verdict.FAIL if node.strict_presets else Verdict.WARN
    results: list[tuple[str, Verdict, str]] = []
    for preset in node.presets:
        verdict, note = _seccomp_state(node.at(node.seccomp_dir / presets.seccomp_file(preset)))
        results.append((preset, missing if verdict is None else verdict, note))
    return _aggregate(
        "seccomp profiles", results, f"in {node.seccomp_dir}",
        f"fuse-device-plugin install-profiles --source DIR --seccomp-dir {node.seccomp_dir}; "
        "--preset checks only the presets this node uses")


def check_cgroup(node: Node) -> Check:
    """Which device cgroup the runtime programs: it decides how to debug an EPERM on open."""
    name, base = "cgroup", node.at("/sys/fs/cgroup")
    if (base / "cgroup.controllers").is_file():
        return Check(name, Verdict.OK, "v2 (unified): device access is an eBPF program per "
                     "container; there is no devices.list to read")
    if (base / "unified" / "cgroup.controllers").is_file():
        return Check(name, Verdict.OK, "hybrid: device access is the v1 devices controller "
                     "(devices.list in the container's cgroup)")
    if (base / "devices").is_dir():
        return Check(name, Verdict.OK, "v1: device access is the devices controller "
                     "(devices.list in the container's cgroup)")
    return Check(name, Verdict.WARN, "cannot tell: /sys/fs/cgroup has neither "
                 "cgroup.controllers nor a devices controller",
                 "mount the node's /sys under --root")


def run_checks(node: Node) -> list[Check]:
    """Every check in the order a FUSE mount needs them; lines that cannot apply are left out."""
    checks = [check_fuse_filesystem(node), *check_device(node)]
    plugin_dir = check_plugin_dir(node)
    checks.append(plugin_dir)
    if plugin_dir.verdict is Verdict.OK:
        checks += [check_kubelet_socket(node), check_plugin_socket(node)]
    checks += check_apparmor(node)
    checks += [check_seccomp(node), check_cgroup(node)]
    return checks


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.verdict is Verdict.FAIL for c in checks) else 0


# -- output --------------------------------------------------------------------------

def render_text(checks: Sequence[Check]) -> str:
    width = max(len("CHECK"), *(len(c.name) for c in checks))
    lines = [f"{'CHECK':<{width}}  VERDICT  DETAIL"]
    for check in checks:
        lines.append(f"{check.name:<{width}}  {check.verdict.value:<7}  {check.detail}")
        if check.fix and check.verdict is not Verdict.OK:
            lines.append(f"{'':<{width}}  {'':<7}  fix: {check.fix}")
    counts = {v: sum(c.verdict is v for c in checks) for v in Verdict}
    lines.append(", ".join(f"{counts[v]} {v.value}" for v in Verdict))
    return "\n".join(lines) + "\n"


def render_json(node: Node, checks: Sequence[Check]) -> str:
    worst = max((c.verdict for c in checks), key=_RANK.__getitem__, default=Verdict.OK)
    document = {"root": str(node.root), "verdict": worst.value,
                "checks": [{"name": c.name, "verdict": c.verdict.value, "detail": c.detail,
                            "fix": c.fix} for c in checks]}
    return json.dumps(document, indent=2) + "\n"


UNEXPLAINED = ("no known FUSE error matches this message; run `fuse-device-plugin doctor` "
               "(without --explain) on the node to check it")


def explain(message: str, output: str, out: TextIO) -> int:
    """Print what ``message`` means; 0 when the table knows it, else 1."""
    from fuse_plugin.doctor import explain

    entries = explain.explain(message)
    if output == "json":
        matches = [{"key": e.key, "errno": e.errno, "meaning": e.meaning,
                    "causes": [{"cause": c.cause, "how_to_tell": c.tell, "fix": c.fix}
                               for c in e.causes_for(message)]} for e in entries]
        document: dict[str, Any] = {"message": message, "matches": matches}
        if not entries:
            document["hint"] = UNEXPLAINED
        out.write(json.dumps(document, indent=2) + "\n")
        return 0 if entries else 1
    if not entries:
        raise Failure(UNEXPLAINED, 1)
    for number, entry in enumerate(entries):
        if number:
            out.write("\n")
        out.write(f"{entry.errno or entry.key}: {entry.meaning}\n")
        for cause in entry.causes_for(message):
            out.write(f"  - {cause.cause}\n    how to tell: {cause.tell}\n"
                      f"    fix: {cause.fix}\n")
    return 0


# -- the command ---------------------------------------------------------------------

# Same flags and environment twins as `serve`, so `kubectl exec` into the plugin's pod
# checks what the plugin itself uses.
_SHARED_FLAGS = ("--device-plugin-dir", "--resource-name", "--fuse-device", "--instance")


def add_flags(parser: argparse.ArgumentParser) -> None:
    config.add_serve_flags(parser, only=_SHARED_FLAGS)
    parser.add_argument("--root", type=args.absolute_path, default=Path("/"), metavar="DIR",
                        help="read every node path under this directory, e.g. /host in a pod "
                             "that mounts the node's / there (default: /)")
    parser.add_argument("--seccomp-dir", type=args.absolute_path, metavar="DIR",
                        default=DEFAULT_SECCOMP_DIR,
                        help=f"where install-profiles puts seccomp profiles "
                             f"(default: {DEFAULT_SECCOMP_DIR})")
    parser.add_argument("--preset", action="append", choices=PRESETS,
                        help="a profile preset this node must have (repeatable); missing ones "
                             "then fail. Default: all presets, missing ones warn")
    parser.add_argument("--output", type=args.choice(OUTPUTS), default="text",
                        metavar="{text,json}",
                        help="text (a table) or json")
    parser.add_argument("--explain", metavar="MESSAGE",
                        help="explain a FUSE error message instead of checking the node")


def run(parsed: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``doctor`` from parsed flags; raises Failure for errors the user must fix."""
    out = out or sys.stdout  # looked up now: a test may have replaced it
    if parsed.explain is not None:
        if not parsed.explain.strip():
            raise Failure("--explain needs the error message, e.g. --explain "
                          "\"fusermount3: mount failed: Operation not permitted\"", EXIT_USAGE)
        return explain(parsed.explain, parsed.output, out)
    if not parsed.root.is_dir():
        raise Failure(f"--root {parsed.root} is not a directory", EXIT_USAGE)
    presets = tuple(dict.fromkeys(parsed.preset)) if parsed.preset else PRESETS
    node = Node(root=parsed.root, device_plugin_dir=parsed.device_plugin_dir,
                fuse_device=parsed.fuse_device, resource_name=parsed.resource_name,
                instance=parsed.instance, seccomp_dir=parsed.seccomp_dir, presets=presets,
                strict_presets=bool(parsed.preset))
    checks = run_checks(node)
    out.write(render_json(node, checks) if parsed.output == "json" else render_text(checks))
    return exit_code(checks)
