"""A small reader for the Dockerfiles and .dockerignore, enough for the structural checks in test_dockerfiles.py
(hadolint does the linting)."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path
from typing import NamedTuple

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


class Instruction(NamedTuple):
    stage: str  # the name of the stage it belongs to ("" before the first FROM)
    keyword: str
    args: str


def parse(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out, stage, pending = [], "", ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = " ".join((pending + line).split())
        pending = ""
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword not in INSTRUCTIONS:
            raise ValueError(f"{path}: unknown instruction {keyword!r}")
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            if m is None:
                raise ValueError(f"{path}: cannot read FROM {args!r}")
            stage = m.group(2) or m.group(1)
        out.append(Instruction(stage, keyword, args))
    if pending:
        raise ValueError(f"{path}: the last instruction ends with a line continuation")
    return out


def stages(instructions: list[Instruction]) -> list[str]:
    return [i.stage for i in instructions if i.keyword == "FROM"]


def copy_sources(instructions: list[Instruction]) -> list[str]:
    """Sources of every COPY from the build context (not --from another stage)."""
    sources = []
    for i in instructions:
        if i.keyword != "COPY":
            continue
        words = shlex.split(i.args)
        if any(w.startswith("--from=") for w in words):
            continue
        sources += [w for w in words if not w.startswith("--")][:-1]
    return sources


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's `patterns` keep `rel` (a path relative to the context) out: the last pattern that
    matches the path or one of its parent folders decides; `!` lets it back in; `**` spans folders."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    out = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        if pattern.startswith("**/"):
            rest = pattern[3:]
            hit = any(fnmatch.fnmatchcase(p, rest) for p in parts)
        else:
            hit = any(fnmatch.fnmatchcase(p, pattern) for p in prefixes)
        if hit:
            out = not negate
    return out


def dockerignore(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
