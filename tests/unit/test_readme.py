"""The README stays true: its commands and flags are the project's own, and the one error
table (docs/errors.md, which the README points to) is the one doctor explains from."""

from __future__ import annotations

from pathlib import Path

from fuse_plugin import args, config
from fuse_plugin.doctor import explain as fuse_errors

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_setup_commands_ci_runs() -> None:
    block = README.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    commands = [line.split("#", 1)[0].strip() for line in block]
    assert commands == ["./scripts/install && .venv/bin/fuse-device-plugin demo",
                        "./scripts/test"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "./scripts/test"
    for script in ("scripts/install", "scripts/test"):
        assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"


def test_every_serve_flag_and_its_environment_twin_is_documented() -> None:
    for flag, _, _ in config.SERVE_FLAGS:
        row = f"| `{flag}` | `{args.env_name(flag)}` | `{args.default(config.Settings, flag)}` |"
        assert row in README, f"README's flag table lacks {row}"


def test_error_table_is_the_one_doctor_explains_from() -> None:
    errors = (ROOT / "docs" / "errors.md").read_text()
    assert fuse_errors.markdown() in errors, (
        "docs/errors.md's table differs from fuse_plugin/doctor/explain.py: paste "
        "`python -c 'from fuse_plugin.doctor import explain; print(explain.markdown())'`")
    assert "](docs/errors.md)" in README
