"""SGLang's `--tool-call-parser` names -> parsers: every format module imported (each files its parsers in
tool_formats.TOOL_CALL_PARSERS as it loads), and one parser made per sample by name."""

from __future__ import annotations

from typing import Sequence

from radixmesh.services.router import harmony, tool_formats_tagged  # noqa: F401  (they register their formats)
from radixmesh.services.router.tool_formats import TOOL_CALL_PARSERS
from radixmesh.services.router.tool_parsers import ToolCallParser

__all__ = ["TOOL_CALL_PARSERS", "make_tool_parser"]


def make_tool_parser(name: str, tools: Sequence[dict]) -> ToolCallParser:
    """A fresh parser for one sample; ValueError naming the known parsers for an unknown name."""
    cls = TOOL_CALL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return cls(tools)
