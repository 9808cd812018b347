"""A tenant that preys on the broker's helper (issue 34), run inside a test container
(stdlib only, beside attacker.py). While one thread of it asks the broker for mounts,
one after another (mount, then unmount), the main thread watches its own PID
namespace for the helper's process there and, for each one it catches, tries what the
pod's root can try with containerd's default capabilities:

    prey.py look ROUNDS DIR     signal 0 (may it signal?), ptrace, /proc/PID/{fd,fdinfo,
                                root,cwd,mem,environ,ns}, pidfd_open + pidfd_getfd,
                                prlimit, setpriority (to the value it has): nothing
                                that changes the process
    prey.py stop ROUNDS DIR     SIGSTOP, and nothing else
    prey.py kill ROUNDS DIR     SIGKILL, and nothing else
    prey.py watch ROUNDS DIR    catch it and do nothing to it
    prey.py none ROUNDS DIR     only the mounts: a neighbour that watches nothing

``--hits N``: after N signals have landed, catch but do not signal (a stopped helper
costs its request the broker's deadline on a broker that does not notice).

It prints one JSON object: ``caught`` (helper processes seen), ``probes`` (for each
probe, how often it worked, ``ok``, or which errno it met), ``fds`` (the most
descriptors one caught process was seen to hold, where listing them was allowed),
``uids`` (the Uid line of /proc/PID/status of each one, as this namespace sees it)
``cgroups`` (each accounting line of /proc/PID/cgroup, memory, cpu, cpuacct and pids,
with how often it was seen: whose cgroups the process is charged to) and ``answers``
(the broker's answers to the mounts: counts and messages).

The watch does not scan /proc: it reads ns_last_pid, so it sees each new pid of the
namespace as soon as the kernel hands it out, and pins the process with a pidfd before
it looks at it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.lib import attacker
else:  # in the container, beside it
    import attacker

HELPER_COMM = "fuse-broker-hel"  # the comm of fuse-broker-helper (15 characters)
ACCOUNTING = {"memory", "cpu", "cpuacct", "pids", ""}  # "": cgroup v2's one line
SYS_PIDFD_GETFD = 438
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
WALL = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


class Tally:
    def __init__(self) -> None:
        self.probes: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)

    def note(self, probe: str, err: int | None) -> None:
        self.probes[probe]["ok" if err is None else errno.errorcode.get(err, str(err))] += 1

    def attempt(self, probe: str, call: Any, *args: Any) -> Any:
        try:
            result = call(*args)
        except OSError as failed:
            self.note(probe, failed.errno)
            return None
        self.note(probe, None)
        return result


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pidfd_getfd(pidfd: int, target: int) -> int:
    fd = int(libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0))
    if fd == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def ptrace_seize(pid: int) -> None:
    if libc.ptrace(PTRACE_SEIZE, pid, None, None) == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    # Ours: let it go again (interrupt, wait for the stop, detach).
    libc.ptrace(PTRACE_INTERRUPT, pid, None, None)
    with contextlib.suppress(OSError):
        os.waitpid(pid, WALL)
    libc.ptrace(PTRACE_DETACH, pid, None, None)


def renice(pid: int) -> None:
    """setpriority to the priority it has: the kernel's permission check, no change."""
    os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, pid))


def list_fds(pid: int) -> list[str]:
    return os.listdir(f"/proc/{pid}/fd")


def look(pid: int, pidfd: int, tally: Tally, held: list[int]) -> None:
    """Every probe that leaves the process as it was."""
    tally.attempt("signal", signal.pidfd_send_signal, pidfd, 0)
    tally.attempt("ptrace", ptrace_seize, pid)
    fds = tally.attempt("fd-list", list_fds, pid)
    if fds is not None:
        held.append(len(fds))
    for fd in fds or ["0"]:
        tally.attempt("fd-readlink", os.readlink, f"/proc/{pid}/fd/{fd}")
        opened = tally.attempt("fd-open", os.open, f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        if opened is not None:
            os.close(opened)
        tally.attempt("fdinfo", read, f"/proc/{pid}/fdinfo/{fd}")
    tally.attempt("root", os.listdir, f"/proc/{pid}/root")
    tally.attempt("cwd", os.listdir, f"/proc/{pid}/cwd")
    for name in ("mem", "environ"):
        tally.attempt(name, read, f"/proc/{pid}/{name}")
    for ns in ("user", "mnt", "pid"):
        opened = tally.attempt("ns", os.open, f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
        if opened is not None:
            os.close(opened)
    for target in range(16):
        taken = tally.attempt("pidfd_getfd", pidfd_getfd, pidfd, target)
        if taken is not None:
            os.close(taken)
    tally.attempt("prlimit", resource.prlimit, pid, resource.RLIMIT_NOFILE)
    tally.attempt("renice", renice, pid)


def churn(rounds: int, directory: str, answers: list[dict[str, Any]]) -> None:
    """Mount and unmount DIR, again and again, as the shim would."""
    os.makedirs(directory, exist_ok=True)
    version = f"v={attacker.VERSION}"
    for _ in range(rounds):
        try:
            answer = attacker.ask_once([version, "op=mount", f"path={directory}"], True, None)
            answers.append(answer)
            if answer["status"] == "ok":
                attacker.ask_once([version, "op=unmount", f"path={directory}"], False, None)
        except Exception as err:  # an answer that never came is an answer to count too
            answers.append({"status": "raised", "message": f"{type(err).__name__}: {err}"})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("look", "stop", "kill", "watch", "none"))
    parser.add_argument("rounds", type=int)
    parser.add_argument("dir")
    parser.add_argument("--hits", type=int, default=sys.maxsize)
    args = parser.parse_args()
    answers: list[dict[str, Any]] = []
    asker = threading.Thread(target=churn, args=(args.rounds, args.dir, answers), daemon=True)
    tally, held, uids = Tally(), list[int](), collections.Counter[str]()
    charged = collections.Counter[str]()
    caught = hits = 0
    ns_last_pid = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
    seen = int(os.pread(ns_last_pid, 32, 0))
    asker.start()
    while args.mode != "none" and asker.is_alive():
        last = int(os.pread(ns_last_pid, 32, 0))
        for pid in range(seen + 1, last + 1):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone already (or a thread of ours)
            try:
                if read(f"/proc/{pid}/comm").decode().strip() != HELPER_COMM:
                    continue
                caught += 1
                status = read(f"/proc/{pid}/status").decode()
                uids[next(line for line in status.splitlines()
                          if line.startswith("Uid:"))] += 1
                for line in read(f"/proc/{pid}/cgroup").decode().splitlines():
                    if ACCOUNTING & set(line.split(":")[1].split(",")):
                        charged[line] += 1
                if args.mode == "look":
                    look(pid, pidfd, tally, held)
                elif args.mode != "watch" and hits < args.hits:
                    sig = signal.SIGSTOP if args.mode == "stop" else signal.SIGKILL
                    tally.attempt(args.mode, signal.pidfd_send_signal, pidfd, sig)
                    hits = tally.probes[args.mode]["ok"]
            except OSError:
                continue  # it exited while we looked
            finally:
                os.close(pidfd)
        seen = max(seen, last)
    asker.join()
    print(json.dumps({"caught": caught, "probes": {k: dict(v) for k, v in tally.probes.items()},
                      "fds": max(held, default=None), "uids": dict(uids),
                      "cgroups": dict(charged),
                      "answers": attacker.tally(answers)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
