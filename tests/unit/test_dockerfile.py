"""The Dockerfile, checked without a container engine: it parses into the two stages the
issue asks for, the wheel it copies is the one ``pip wheel .`` builds, and the image's
entrypoint is the package's console script."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fuse_plugin import __version__, cli
from tests.lib.dockerfile import BUILDER, GLOBAL_ARGS, RUNTIME, STAGES, Instruction, parse

ROOT = Path(__file__).resolve().parents[2]


def project_version() -> str:
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match, "pyproject.toml has no version"
    return match.group(1)


def expected_wheel() -> str:
    match = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match, "pyproject.toml has no name"
    # Wheel file names normalise the project name (PEP 427 / PEP 503).
    name = re.sub(r"[-_.]+", "_", match.group(1)).lower()
    return f"{name}-{project_version()}-py3-none-any.whl"


def exec_form(instruction: Instruction) -> list[str]:
    value: object = json.loads(instruction.value)
    assert isinstance(value, list), f"line {instruction.line}: use the JSON (exec) form"
    return [str(v) for v in value]


def test_parser_rejects_what_it_does_not_understand() -> None:
    with pytest.raises(ValueError, match="unknown instruction"):
        parse("FROM x\nRUNN true\n")
    with pytest.raises(ValueError, match="continuation"):
        parse("FROM x\nRUN true \\\n")


def test_two_stages_builder_then_slim_runtime() -> None:
    assert len(STAGES) == 2
    assert BUILDER is not None
    assert RUNTIME is not None
    assert BUILDER.name == "builder"
    assert BUILDER.base == RUNTIME.base == "${PYTHON_IMAGE}"
    assert GLOBAL_ARGS["PYTHON_IMAGE"] == "python:3.11-slim"


def test_builder_builds_only_our_wheel_from_what_dockerignore_lets_in() -> None:
    assert BUILDER is not None
    (wheel,) = [i.value for i in BUILDER.all("RUN") if "pip wheel" in i.value]
    words = shlex.split(wheel)
    assert {"--no-deps", "--no-cache-dir"} <= set(words)
    assert words[-1] == "."
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert ignore[0] == "*", ".dockerignore is an allow-list"
    for copy in BUILDER.all("COPY"):
        for source in shlex.split(copy.value)[:-1]:
            path = Path(source.rstrip("/"))
            assert {str(path), *map(str, path.parents)} & allowed, \
                f"{source} is excluded by .dockerignore"
            assert (ROOT / source).exists()
    for excluded in (".venv", ".git", "tests", "bench"):
        assert not any(fnmatch.fnmatch(excluded, a) for a in allowed)


def test_runtime_copies_the_wheel_pip_builds(tmp_path: Path) -> None:
    """The runtime installs every wheel the builder's directory holds, and the builder's
    own command makes exactly one: ours, named by pyproject.toml's version (the only
    place it is written)."""
    assert RUNTIME is not None
    (copy,) = [c for c in RUNTIME.all("COPY") if "--from=builder" in c.value
               and "/wheels/" in c.value]
    words = shlex.split(copy.value)
    assert words[1:] == ["/wheels/", "/tmp/wheels/"]
    # The builder stage's own command (isolated build: setuptools comes from PyPI).
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--no-cache-dir", "--quiet", "--wheel-dir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr
    wheels = [p.name for p in tmp_path.glob("*.whl")]
    assert wheels == [expected_wheel()]
    (install,) = [i.value for i in RUNTIME.all("RUN") if "pip install" in i.value]
    assert "/tmp/wheels/*.whl" in install
    assert "--no-cache-dir" in install


def test_a_python_change_does_not_rebuild_the_compiler_layer() -> None:
    """The builder installs the compiler and builds the C programs before it copies the
    Python package: a change to the package leaves those layers cached."""
    assert BUILDER is not None
    steps = [i.value for i in BUILDER.instructions]
    compiler = next(n for n, v in enumerate(steps) if "musl-tools" in v)
    native = next(n for n, v in enumerate(steps) if v.startswith("scripts/build-native"))
    package = next(n for n, v in enumerate(steps) if v.split()[0] == "fuse_plugin")
    assert compiler < native < package


def test_runtime_has_no_compilers_or_caches() -> None:
    assert RUNTIME is not None
    for run in RUNTIME.all("RUN"):
        for tool in ("build-essential", "gcc", "g++", "make ", "python3-dev"):
            assert tool not in run.value, f"line {run.line}: {tool.strip()} in the image"
        if "apt-get install" in run.value:
            assert "--no-install-recommends" in run.value
            assert "rm -rf /var/lib/apt/lists/*" in run.value
        if "pip install" in run.value:
            assert "--no-cache-dir" in run.value
    # install-profiles runs apparmor_parser.
    assert any("apt-get install" in r.value and " apparmor" in r.value
               for r in RUNTIME.all("RUN"))


def test_entrypoint_is_the_console_script_and_runs_serve() -> None:
    assert RUNTIME is not None
    (entrypoint,) = RUNTIME.all("ENTRYPOINT")
    (command,) = RUNTIME.all("CMD")
    assert exec_form(entrypoint) == ["fuse-device-plugin"]
    assert exec_form(command) == ["serve"]
    assert cli.build_parser(exec_form(command)).parse_args(exec_form(command)).command == "serve"
    scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n",
                        (ROOT / "pyproject.toml").read_text(), re.S)
    assert scripts
    assert 'fuse-device-plugin = "fuse_plugin.cli:main"' in scripts.group(1)
    (stop,) = RUNTIME.all("STOPSIGNAL")
    assert stop.value == "SIGTERM"


def test_labels_carry_the_project_version() -> None:
    assert RUNTIME is not None
    labels = " ".join(i.value for i in RUNTIME.all("LABEL"))
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    (version_arg,) = [i.value for i in RUNTIME.all("ARG") if i.value.startswith("VERSION=")]
    assert version_arg == f"VERSION={project_version()}" == f"VERSION={__version__}"
    assert 'org.opencontainers.image.version="${VERSION}"' in labels


def test_example_tool_image_dockerfile() -> None:
    _, stages = parse((ROOT / "manifests" / "examples" / "Dockerfile").read_text())
    (stage,) = stages
    assert stage.base.startswith("debian:")
    (run,) = stage.all("RUN")
    assert "--no-install-recommends" in run.value
    assert "rm -rf /var/lib/apt/lists/*" in run.value
