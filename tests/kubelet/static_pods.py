"""Static pods on the real kubelet, and the evidence they leave: the helpers the
kubelet stage's test modules share (their fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.kubelet import node as nodemod

HERE = Path(__file__).resolve().parent


SLOTS = 4
RESOURCE = "github.com/fuse"
SECCOMP_SUBDIR = "fuse-device-plugin"
SETUP_TIMEOUT = 1500  # a cold kubelet build is ~5 min on 2 cores; apt may wait for a lock


KUBELET_LOG = nodemod.LOGDIR / "kubelet.log"
EVIDENCE = nodemod.LOGDIR / "evidence.txt"


def command_output(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0] if out else "?"


def _skip_reason() -> str | None:
    return nodemod.skip_reason("real-kubelet e2e stage")


# ---------------------------------------------------------------- evidence / reporting


def evidence(scenario: str, lines: list[str] | str) -> None:
    if isinstance(lines, str):
        lines = [lines]
    text = "".join(f"[{scenario}] {line}\n" for line in lines)
    print(text, end="")
    with open(EVIDENCE, "a") as f:
        f.write(text)


def kubelet_lines(since: int, *patterns: str) -> list[str]:
    rx = re.compile("|".join(patterns))
    return [ln for ln in nodemod.read_log(KUBELET_LOG, since).splitlines() if rx.search(ln)]


def pod_report(node: Any, pod: dict[str, Any] | None, since: int, name: str) -> str:
    """What the kubelet reported about a pod: status, its log lines, the container log."""
    parts = []
    if pod is None:
        parts.append(f"the kubelet's /pods has no pod {name}-{nodemod.NODE_NAME} of this run")
    else:
        parts.append(
            "pod status from the kubelet's /pods:\n" + json.dumps(pod.get("status"), indent=1)
        )
        for c in pod["spec"]["containers"]:
            with contextlib.suppress(OSError, KeyError):
                parts.append(f"container log ({c['name']}):\n{node.container_log(pod, c['name'])}")
    uid = pod["metadata"]["uid"] if pod else None
    pats = [re.escape(name)] + ([re.escape(uid)] if uid else [])
    lines = kubelet_lines(since, *pats)
    lines = [ln for ln in lines if "Pod status updated" not in ln][-40:]
    parts.append("kubelet log lines about it:\n" + "\n".join(lines))
    return "\n".join(parts)


# ---------------------------------------------------------------- pods


def container(node: Any, script: str, fuse: int | None = 1, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": "c",
        "image": node.images["WORKLOAD_IMAGE"],
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script],
        **extra,
    }
    if fuse is not None:
        c["resources"] = {"limits": {RESOURCE: str(fuse)}}
    return c


def pod_spec(
    *containers: dict[str, Any], volumes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    # No CNI on this node: the kubelet only starts hostNetwork pods.
    spec: dict[str, Any] = {
        "hostNetwork": True,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 2,
        "containers": list(containers),
    }
    if volumes:
        spec["volumes"] = volumes
    return spec


class PodRun:
    def __init__(self, node: Any, name: str, spec: dict[str, Any]) -> None:
        self.node, self.name = node, name
        self.since = nodemod.log_size(KUBELET_LOG)
        self.run_id = node.add_pod(name, spec)
        self.pod: dict[str, Any] | None = None

    def wait_done(self, timeout: float = 90) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            bad = kubelet_lines(
                self.since, r"Can't process manifest file .*/" + re.escape(self.name) + r"\.json"
            )
            if bad:
                raise AssertionError(f"the kubelet refused the manifest of {self.name}:\n{bad[0]}")
            p = self.node.find_pod(self.name, self.run_id)
            self.pod = p
            return p if p and p.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

        pod: dict[str, Any] = nodemod.wait_for(
            done,
            timeout,
            f"pod {self.name} to finish (phase Succeeded or Failed)",
            interval=0.5,
            detail=lambda: pod_report(self.node, self.pod, self.since, self.name),
        )
        self.pod = pod
        return pod

    @property
    def phase(self) -> str:
        return str((self.pod or {}).get("status", {}).get("phase", "?"))

    def log(self) -> str:
        assert self.pod is not None
        return str(self.node.container_log(self.pod, "c"))

    def report(self) -> str:
        return pod_report(self.node, self.pod, self.since, self.name)

    def expect(self, phase: str, timeout: float = 90) -> dict[str, Any]:
        pod = self.wait_done(timeout)
        assert self.phase == phase, (
            f"expected pod {self.name} to end {phase}, the kubelet reports {self.phase}\n"
            + self.report()
        )
        return pod

    def remove(self) -> None:
        self.node.remove_pod(self.name)


@contextlib.contextmanager
def pods(node: Any, **specs: dict[str, Any]) -> Iterator[dict[str, PodRun]]:
    """Start several static pods at once (the kubelet runs them in parallel); remove them after."""
    runs = {name: PodRun(node, name, spec) for name, spec in specs.items()}
    try:
        yield runs
    finally:
        for r in runs.values():
            r.remove()


# The kubelet's line when a device plugin registers (1.37's wording).
REGISTRATION = (r'Got registration request from device plugin with resource" '
                r'resourceName="github.com/fuse"')


def wait_registered(node: Any, since: int, when: str) -> list[str]:
    """The kubelet's own log: registration accepted and the device list pushed; then the
    registration must stay up."""
    reg = re.compile(REGISTRATION)
    push = re.compile(r'State pushed for device plugin" resource="github.com/fuse"')

    def seen() -> tuple[list[str], int] | None:
        text = nodemod.read_log(KUBELET_LOG, since)
        m = reg.search(text)
        p = push.search(text, m.end()) if m else None
        if not (m and p):
            return None
        line_end = text.find("\n", p.end())
        end = len(text) if line_end < 0 else line_end + 1
        lines = [
            text[text.rfind("\n", 0, x.start()) + 1 : text.find("\n", x.end())] for x in (m, p)
        ]
        return lines, since + len(text[:end].encode())

    found: tuple[list[str], int] = nodemod.wait_for(
        seen,
        45,
        f"the kubelet to log the registration of {RESOURCE} ({when})",
        interval=0.3,
        detail=lambda: (
            nodemod.tail(KUBELET_LOG, 30) + "\n" + nodemod.tail(nodemod.LOGDIR / "plugin.log", 20)
        ),
    )
    lines, offset = found
    assert_registration_stable(lines[-1], offset, when)
    return lines


STABLE_WINDOW = 3.0


def assert_registration_stable(after_line: str, since: int, when: str) -> None:
    """Once registered, the kubelet's endpoint must stay up: no 'listAndWatch ended
    unexpectedly' (which marks every device unhealthy) and no second registration in the
    seconds after the first one was pushed (from log offset since)."""
    deadline = time.monotonic() + STABLE_WINDOW
    while time.monotonic() < deadline:
        churn = kubelet_lines(
            since,
            r'ListAndWatch ended unexpectedly for device plugin".* resource="github.com/fuse"',
            REGISTRATION,
        )
        if churn:
            churn = kubelet_lines(
                since,
                r'ended unexpectedly for device plugin".* resource="github.com/fuse"',
                r"Got registration request .*github.com/fuse",
                r"Mark all resources Unhealthy",
            )
            plugin = nodemod.read_log(nodemod.LOGDIR / "plugin.log").splitlines()[-15:]
            raise AssertionError(
                f"expected the registration of {RESOURCE} ({when}) to stay up after\n"
                f"  {after_line}\nbut within {STABLE_WINDOW:.0f}s the kubelet logged "
                f"{len(churn)} lines of endpoint churn "
                f"(each marks all devices unhealthy):\n"
                + "\n".join(churn[:12])
                + "\n--- last plugin log lines:\n"
                + "\n".join(plugin)
            )
        time.sleep(0.2)
