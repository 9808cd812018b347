"""Every command the scripts and tests run on this machine comes from a Debian package
that ``scripts/apt-packages.txt`` lists (or one every Debian system has).

A machine that has a tool by accident keeps CI green while a fresh one fails: ``depmod``
(kmod) once failed 88 tests on a new machine. Commands are found where they are spelled
out: ``shutil.which("x")`` and ``subprocess.*(["x", ...`` in Python, and the first word
of each command in the shell scripts that run on the host.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ROOT / "scripts" / "apt-packages.txt"
# Scripts run inside the AppArmor guest: their commands come from the guest's own
# debootstrap, which build-guest.sh lists.
GUEST_ONLY = {"confined.sh", "guest-tests.sh", "workloads.sh", "init"}
HOST_SCRIPTS = sorted(
    [p for p in ROOT.glob("tests/**/*.sh") if p.name not in GUEST_ONLY]
    + [ROOT / "scripts" / "install", ROOT / "scripts" / "test", ROOT / "scripts" / "build-helm",
       ROOT / ".ci" / "run"])
PYTHON_SOURCES = sorted(
    p for p in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("fuse_plugin/**/*.py"),
                *ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py")]
    if p != Path(__file__).resolve())
# The machine's own toolchains, installed before any session on this kind of machine
# (the environment's machine description), not from a Debian package.
MACHINE = {"go": "tests/stack/build.sh builds Kubernetes, containerd, runc, etcd and the CNI "
                 "plugins with the machine's Go (/usr/local/go)"}
# Called only when present, with a skip that says so: not on a fresh machine's path.
OPTIONAL = {"kubectl": "tests/unit/test_manifests.py skips `kubectl kustomize` without it",
            "perf": "bench.broker's step breakdown (perf trace) is left out without it"}
SHELL_WORDS = {
    "if", "then", "else", "elif", "fi", "for", "in", "do", "done", "case", "esac", "while",
    "until", "function", "local", "echo", "printf", "read", "set", "export", "return",
    "exit", "cd", "test", "true", "false", "shift", "trap", "wait", "eval", "source",
    "declare", "mapfile", "command", "type", "unset", "break", "continue", "readonly",
    "getopts", "kill", "pwd", "umask", "ulimit", "exec", "time", "select", "let", "hash",
    "builtin", "cat", "[[", "]]",
}
VENV_BIN = Path(sys.executable).parent
# The scripts run Go from Debian's versioned directory rather than from PATH.
PATH = os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", ""), "/usr/local/sbin",
                        "/usr/sbin", "/sbin", *map(str, Path("/usr/lib").glob("go-*/bin"))])


def python_commands(path: Path) -> set[str]:
    text = path.read_text()
    found = set(re.findall(r"""which\(\s*["']([A-Za-z][\w.+-]*)["']""", text))
    constants = dict(re.findall(r"""^([A-Z_]+) = ["']([\w.+-]+)["']""", text, re.M))
    found |= {constants[name] for name in re.findall(r"which\(\s*([A-Z_]+)\s*\)", text)
              if name in constants}
    found |= set(re.findall(
        r"""(?:run|Popen|check_output|check_call|call)\(\s*\[\s*["']([a-z][\w.+-]*)["']""",
        text))
    return found


def shell_commands(path: Path) -> set[str]:
    text = path.read_text()
    functions = set(re.findall(r"^\s*(?:function\s+)?([\w-]+)\s*\(\)", text, re.M))
    found: set[str] = set()
    in_array = False
    for raw in text.splitlines():
        if in_array or re.match(r"\s*\w+=\([^)]*$", raw):  # a list over several lines
            in_array = ")" not in raw if in_array else True
            continue
        # Quoted words stand in place (so what follows them is not taken for a command);
        # comments go.
        line = re.sub(r"""'[^']*'|"(?:[^"\\]|\\.)*"|(?:^|\s)#.*$""", " _quoted_ ", raw)
        for match in re.finditer(
                r"(?:^|[|;&]|\$\(|\bthen\b|\bdo\b|\belse\b|\bexec\b|\btimeout\s+\d+\w*)"
                r"\s*([a-z][\w.+-]*)(?=\s|$|;)", line):
            word = match.group(1)
            if word not in SHELL_WORDS and word not in functions and "=" not in word:
                found.add(word)
    return found


def called() -> dict[str, set[str]]:
    commands: dict[str, set[str]] = {}
    for path in PYTHON_SOURCES:
        for command in python_commands(path):
            commands.setdefault(command, set()).add(str(path.relative_to(ROOT)))
    for path in HOST_SCRIPTS:
        for command in shell_commands(path):
            commands.setdefault(command, set()).add(str(path.relative_to(ROOT)))
    return commands


@cache
def listed() -> frozenset[str]:
    lines = PACKAGES.read_text().splitlines()
    return frozenset(line.split()[0] for line in lines
                     if line.strip() and not line.lstrip().startswith("#"))


def package_of(executable: str) -> str | None:
    """dpkg's owner of a file; with merged /usr, dpkg may know /usr/bin/x as /bin/x."""
    real = os.path.realpath(executable)
    candidates = [executable, real]
    candidates += [re.sub(r"^/usr/(s?bin)/", r"/\1/", path) for path in candidates]
    for candidate in dict.fromkeys(candidates):
        result = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True,
                                text=True, check=False)
        owners = [line.split(":", 1)[0].split(",")[0].strip()
                  for line in result.stdout.splitlines()
                  if line and not line.startswith("diversion by ")]
        if result.returncode == 0 and owners:
            return owners[0]
    return None


def always_there(package: str) -> bool:
    """Essential or priority required: debootstrap puts these on every Debian system."""
    result = subprocess.run(["dpkg-query", "-W", "-f=${Essential} ${Priority}", package],
                            capture_output=True, text=True, check=False)
    essential, _, priority = result.stdout.partition(" ")
    return essential == "yes" or priority == "required"


COMMANDS = called()


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_comes_from_a_listed_package(command: str) -> None:
    where = ", ".join(sorted(COMMANDS[command]))
    if command in OPTIONAL:
        pytest.skip(f"{command}: optional, {OPTIONAL[command]}")
    if command in MACHINE:
        assert shutil.which(command, path=PATH), f"{command}: {MACHINE[command]}; none here"
        return
    executable = shutil.which(command, path=PATH)
    if executable is None:
        pytest.fail(f"{command} (called in {where}) is not installed here: add its Debian "
                    f"package to {PACKAGES.relative_to(ROOT)}")
    if Path(executable).parent == VENV_BIN or executable.startswith(str(ROOT)):
        return  # installed by pip into .venv, or the project's own
    package = package_of(executable)
    assert package is not None, f"{command} ({executable}, called in {where}) belongs to " \
                                "no Debian package: install it from one the list names"
    assert package in listed() or always_there(package), (
        f"{command} (called in {where}) comes from Debian package {package}, which "
        f"{PACKAGES.relative_to(ROOT)} does not list")


def test_the_extraction_finds_what_it_must() -> None:
    """The scanner itself: depmod (the command that once broke a fresh machine), runc
    and apparmor_parser are among the commands found."""
    assert {"depmod", "runc", "apparmor_parser"} <= COMMANDS.keys()
