"""Argument types and flags every command shares: each turns a bad value into argparse's
one-line usage error (exit 2), and every flag may have an environment twin
(``FUSE_DEVICE_PLUGIN_<FLAG>``), which a DaemonSet can set instead of its args.

A number is ASCII digits only: ``int()`` alone strips spaces and newlines and takes a
sign, underscores and any script's digits ('\u0661\u0662' is 12), so a manifest's typo
would be read as some number.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from fuse_plugin import logs

ENV_PREFIX = "FUSE_DEVICE_PLUGIN_"
PATH_MAX = 4095

Parse = Callable[[str], object]
# flag, type, help: a command's table of flags, each named after its settings field.
Flag = tuple[str, Parse, str]
S = TypeVar("S")


def whole_number(text: str, low: int, high: int) -> int | None:
    """``text`` as a number from ``low`` to ``high`` if it is only ASCII digits, else None.

    ``str.isdigit()`` also takes '\u00b2', which ``int()`` refuses; leading zeros are
    allowed, and the length is checked before ``int()``, which refuses more than 4300
    digits with an error of its own.
    """
    if not text or not text.isascii() or not text.isdigit():
        return None
    if len(text.lstrip("0")) > len(str(high)):
        return None
    value = int(text)
    return value if low <= value <= high else None


def shown(text: str, limit: int = 100) -> str:
    """``text`` quoted for an error line, cut at ``limit`` characters: a 5000-digit value
    is one readable line, not a screenful."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def count(low: int, high: int) -> Callable[[str], int]:
    """A whole number from ``low`` to ``high``."""

    def check(text: str) -> int:
        value = whole_number(text, low, high)
        if value is None:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {low} to {high}, got {shown(text)}")
        return value

    return check


def port(text: str) -> int:
    value = whole_number(text, 0, 65535)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be a TCP port from 0 to 65535, got {shown(text)}")
    return value


def address(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an IP address such as 0.0.0.0 or 127.0.0.1, got {text!r}") from None
    return text


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return value in ("true", "1", "yes")


def absolute_path(text: str) -> Path:
    if not text or "\0" in text or not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be an absolute path, got {text[:100]!r}")
    try:
        encoded = text.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"must be valid UTF-8, got {text[:100]!r}") from None
    if len(encoded) > PATH_MAX:
        raise argparse.ArgumentTypeError(
            f"must be at most {PATH_MAX} bytes, got {len(encoded)}")
    return Path(text)


def optional_path(text: str) -> Path | None:
    """An absolute path, or empty for "off"."""
    return absolute_path(text) if text else None


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text.lower() not in options:
            raise argparse.ArgumentTypeError(
                f"must be one of {', '.join(options)}, got {text!r}")
        return text.lower()
    return check


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class _FromEnv(str):
    """A default read from the environment; argparse runs string defaults through `type`."""

    env = ""


def _checked(kind: Parse) -> Parse:
    def check(text: str) -> object:
        try:
            # A plain str: a parser that returns its text as it is would otherwise hand on
            # the _FromEnv subclass, which encoders (msgspec's JSON) refuse.
            return kind(str(text))
        except argparse.ArgumentTypeError as err:
            if isinstance(text, _FromEnv):
                raise argparse.ArgumentTypeError(f"{err} (from ${text.env})") from None
            raise
    return check


def add(parser: argparse.ArgumentParser, flag: str, kind: Parse, default: object,
        help_text: str, *, metavar: str | None = None, dest: str | None = None) -> None:
    """One flag with its environment twin, which supplies the default when set; a bad
    value from either is the same one-line error, naming the variable when it came
    from there."""
    env = env_name(flag)
    value: object = default
    if env in os.environ:
        value = _FromEnv(os.environ[env])
        value.env = env
    # A boolean flag may stand alone (`--cdi`) or take a value (`--cdi false`).
    extra: dict[str, object] = {"nargs": "?", "const": True} if kind is boolean else {}
    if metavar is not None:
        extra["metavar"] = metavar
    if dest is not None:  # a field not named after its flag: help still shows the flag's
        extra["dest"] = dest
        extra.setdefault("metavar", field_name(flag).upper())
    parser.add_argument(flag, type=_checked(kind), default=value, **extra,  # type: ignore[arg-type]
                        help=f"{help_text} (env {env}; default: {default})")


@dataclass(frozen=True)
class DaemonSettings:
    """The fields every node daemon's settings hold (the plugin's, the broker's, the DRA
    driver's), from ``add_log_flags``; each wing's dataclass adds its own after them."""

    log_format: str = "text"
    log_level: str = "info"


@dataclass(frozen=True)
class MetricsSettings(DaemonSettings):
    """And the HTTP port of /metrics and the probes, --metrics-port and --metrics-address,
    as the plugin and the broker name it (the DRA driver's is --probe-port, its own)."""

    metrics_port: int = 0  # 0: off
    metrics_address: str = "0.0.0.0"


# The flags of MetricsSettings' fields, for the tables of the commands that have them.
METRICS_FLAGS: tuple[Flag, ...] = (
    ("--metrics-port", port,
     "serve /metrics, /healthz and /readyz on this port; 0 turns it off"),
    ("--metrics-address", address, "address the metrics port binds to (IPv4 or IPv6)"),
)


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    """--log-format and --log-level, the same for every long-running command."""
    add(parser, "--log-format", choice(logs.FORMATS), "text", "log line format: text or json")
    add(parser, "--log-level", choice(logs.LEVELS), "info", "debug, info, warning or error")


def field_name(flag: str, renamed: Mapping[str, str] | None = None) -> str:
    """The settings field ``flag`` fills: the one named after it, unless ``renamed``
    (flag: field) names another, for a flag older than its field."""
    return (renamed or {}).get(flag) or flag.lstrip("-").replace("-", "_")


def default(settings: type[Any], flag: str, renamed: Mapping[str, str] | None = None) -> object:
    """A flag's default: the default of the settings field it fills, so that the
    dataclass is the one place a default is written."""
    name = field_name(flag, renamed)
    return next(f.default for f in fields(settings) if f.name == name)


def add_table(parser: argparse.ArgumentParser, table: Sequence[Flag], settings: type[Any],
              only: Collection[str] | None = None,
              renamed: Mapping[str, str] | None = None) -> None:
    """Add a command's flags (or ``only`` those), each with its environment twin and its
    default from ``settings``, parsed into the field it fills (``renamed``: where that is
    not the flag's own name); the log flags come with the whole table."""
    for flag, kind, help_text in table:
        if only is None or flag in only:
            add(parser, flag, kind, default(settings, flag, renamed), help_text,
                dest=field_name(flag, renamed))
    if only is None:
        add_log_flags(parser)


def settings_of(settings: type[S], parsed: argparse.Namespace) -> S:
    """The settings dataclass from parsed flags: each field is named after its flag."""
    values = {f.name: getattr(parsed, f.name) for f in fields(settings)}  # type: ignore[arg-type]
    return settings(**values)
