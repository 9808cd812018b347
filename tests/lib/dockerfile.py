"""The project's Dockerfile, parsed without a container engine: its global ARGs and its
stages (the builder and the runtime), instruction by instruction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Instructions with continuations joined, comments dropped, grouped by stage.

    Enough of the Dockerfile grammar for ours: no heredocs, no parser directives other
    than comments. Global ARGs (before the first FROM) are returned with their defaults.
    """
    args: dict[str, str] = {}
    stages: list[Stage] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, value = full.partition(" ")
        keyword = keyword.upper()
        if keyword not in KEYWORDS:
            raise ValueError(f"line {start}: unknown instruction {keyword!r}")
        if keyword == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(words[0], name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"line {start}: {keyword} before the first FROM")
            key, _, default = value.partition("=")
            args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, value.strip(), start))
    if pending:
        raise ValueError("the file ends inside a line continuation")
    return args, stages


KEYWORDS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
            "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
            "SHELL", "MAINTAINER"}

GLOBAL_ARGS, STAGES = parse((ROOT / "Dockerfile").read_text())
BUILDER, RUNTIME = STAGES if len(STAGES) == 2 else (None, None)
