"""Timing loops run *inside* a benchmark container (stdlib only; the container's python3
is the host's). Prints one JSON object. Used by bench/broker.py.

    broker_probe.py mount IMAGE MOUNTPOINT ROUNDS UNMOUNT...
    broker_probe.py read IMAGE MOUNTPOINT FILE ROUNDS UNMOUNT...
    broker_probe.py write DIR NAME MIB            (writes DIR/NAME, fsync'd)
    broker_probe.py readfile PATH
    broker_probe.py cycle IMAGE MOUNTPOINT FILE SECONDS UNMOUNT...
                                (mount, read FILE, unmount, again until SECONDS have
                                 passed; failures are counted, not raised)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CHUNK = 1 << 20


def run(*args: str) -> None:
    subprocess.run(args, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def mount(image: str, point: str, rounds: int, unmount: list[str]) -> dict[str, object]:
    """squashfuse returns once the filesystem is mounted (it daemonizes after that)."""
    os.makedirs(point, exist_ok=True)
    mount_ms, unmount_ms = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        run("squashfuse", image, point)
        mount_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        run(*unmount, point)
        unmount_ms.append((time.perf_counter() - started) * 1000)
    return {"mount_ms": mount_ms, "unmount_ms": unmount_ms}


def read_file(path: str) -> tuple[int, float]:
    started = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as source:
        while chunk := source.read(CHUNK):
            total += len(chunk)
    return total, time.perf_counter() - started


def read(image: str, point: str, name: str, rounds: int, unmount: list[str]
         ) -> dict[str, object]:
    """A fresh mount each round, so nothing comes from the page cache."""
    os.makedirs(point, exist_ok=True)
    rates = []
    for _ in range(rounds):
        run("squashfuse", image, point)
        size, seconds = read_file(f"{point}/{name}")
        rates.append(size / seconds / CHUNK)
        run(*unmount, point)
    return {"read_mib_s": rates}


def write(path: str, mib: int) -> dict[str, object]:
    block = os.urandom(CHUNK)
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as out:
        for _ in range(mib):
            out.write(block)
        os.fsync(out.fileno())
    return {"write_mib_s": [mib / (time.perf_counter() - started)]}


def readfile(path: str) -> dict[str, object]:
    size, seconds = read_file(path)
    return {"read_mib_s": [size / seconds / CHUNK]}


def attempt(*args: str) -> str | None:
    """Run a command; None if it worked, else what it said (its last line)."""
    got = subprocess.run(args, check=False, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if got.returncode == 0:
        return None
    said = got.stderr.decode(errors="replace").strip().splitlines()
    return f"{args[0]} exited {got.returncode}: {said[-1] if said else ''}"[:300]


def cycle(image: str, point: str, name: str, seconds: float, unmount: list[str]
          ) -> dict[str, object]:
    """A well-behaved tenant: mount, read, unmount, for ``seconds``. Every failure is
    kept (the first 20 in full), and the loop goes on."""
    os.makedirs(point, exist_ok=True)
    mount_ms: list[float] = []
    unmount_ms: list[float] = []
    failures: list[dict[str, str]] = []
    failed = 0
    deadline = time.monotonic() + seconds

    def fail(stage: str, message: str) -> None:
        nonlocal failed
        failed += 1
        if len(failures) < 20:
            failures.append({"stage": stage, "message": message,
                             "at_s": f"{seconds - (deadline - time.monotonic()):.2f}"})

    while time.monotonic() < deadline:
        started = time.perf_counter()
        problem = attempt("squashfuse", image, point)
        elapsed = (time.perf_counter() - started) * 1000
        if problem is not None:
            fail("mount", problem)
            continue
        mount_ms.append(elapsed)
        try:
            size, _ = read_file(f"{point}/{name}")
            if size == 0:
                fail("read", f"{name} read empty")
        except OSError as err:
            fail("read", f"{name}: {err.strerror or err}")
        started = time.perf_counter()
        problem = attempt(*unmount, point)
        if problem is None:
            unmount_ms.append((time.perf_counter() - started) * 1000)
        else:
            fail("unmount", problem)
            attempt(*unmount, "-z", point)  # so that the next round can mount again
    return {"mount_ms": mount_ms, "unmount_ms": unmount_ms, "failed": failed,
            "failures": failures}


def main(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    if kind == "mount":
        result = mount(rest[0], rest[1], int(rest[2]), rest[3:])
    elif kind == "read":
        result = read(rest[0], rest[1], rest[2], int(rest[3]), rest[4:])
    elif kind == "cycle":
        result = cycle(rest[0], rest[1], rest[2], float(rest[3]), rest[4:])
    elif kind == "write":
        result = write(f"{rest[0]}/{rest[1]}", int(rest[2]))
    else:
        result = readfile(rest[0])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
