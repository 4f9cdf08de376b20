"""One chat sample's text -> OpenAI message parts: reasoning_content (a --reasoning-parser), content, and tool calls
(the request's tools with --tool-call-parser, or the constrained formats of tool_choice "required" or a named
function). Reasoning is split off first; tool calls are parsed from the answer only.

A stream feeds its pieces in order, then finishes; a whole output goes to `whole` (the reasoning splitter is the
same code either way; tool calls that do not parse stay content in whole outputs). GPT-OSS's channels (harmony.py)
are read by one splitter that gives the reasoning, the content and its own tool calls at once."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from radixmesh.services.router.harmony import HarmonySplitter, HarmonyToolParser, split_harmony
from radixmesh.services.router.reasoning import ReasoningFormat, ReasoningSplitter, split_reasoning


@dataclass(slots=True)
class Parts:
    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)  # tool_parsers.ToolCallDelta, in order

    def add(self, other: Parts) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a request's samples are parsed: `reasoning` is the format when the output is split (None: not split);
    `tools` makes a fresh tool-call parser per sample (None: tool calls are not parsed)."""

    reasoning: ReasoningFormat | None = None
    in_reasoning: bool = False
    tools: Any = None  # a callable () -> tool_parsers.ToolCallParser
    parallel_calls: bool = True  # False: only a sample's first tool call is kept (parallel_tool_calls=false)

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None


class SampleParser:
    def __init__(self, spec: OutputSpec) -> None:
        self.spec = spec
        self.tools = spec.tools() if spec.tools is not None else None
        self.single = not spec.parallel_calls
        self.splitter = self.harmony = None
        self.harmony_tools: dict | None = None  # harmony's own calls (--tool-call-parser gpt-oss with its reasoning)
        if spec.reasoning is not None and spec.reasoning.channels:  # GPT-OSS: one splitter reads both
            if isinstance(self.tools, HarmonyToolParser):
                self.harmony_tools, self.tools = self.tools.tools, None
            self.harmony = HarmonySplitter(True, self.harmony_tools, spec.in_reasoning)
        elif spec.reasoning is not None:
            self.splitter = ReasoningSplitter(spec.reasoning, spec.in_reasoning)

    def feed(self, text: str) -> Parts:
        if self.harmony is not None:
            reasoning, answer, calls = self.harmony.feed(text)
            return self._answer(Parts(reasoning=reasoning, calls=calls), answer, final=False)
        reasoning, answer = self.splitter.feed(text) if self.splitter else ("", text)
        return self._answer(Parts(reasoning=reasoning), answer, final=False)

    def finish(self) -> Parts:
        if self.harmony is not None:
            reasoning, answer, calls = self.harmony.finish()
            return self._answer(Parts(reasoning=reasoning, calls=calls), answer, final=True)
        reasoning, answer = self.splitter.finish() if self.splitter else ("", "")
        return self._answer(Parts(reasoning=reasoning), answer, final=True)

    def whole(self, text: str) -> tuple[str | None, str, list]:
        """(reasoning or None, content, tool_parsers.ToolCall list) of a whole output; tool calls that do not parse
        stay in the content."""
        calls: list = []
        if self.harmony is not None:
            thought, answer, calls = split_harmony(text, True, self.harmony_tools, self.spec.in_reasoning)
        elif self.spec.reasoning is not None:
            thought, answer = split_reasoning(self.spec.reasoning, text, self.spec.in_reasoning)
        else:
            thought, answer = None, text
        if self.tools is not None:
            answer, more = self.tools.parse(answer)
            calls = calls + more
        return thought, answer, calls[:1] if self.single else calls

    def _answer(self, parts: Parts, answer: str, final: bool) -> Parts:
        """`parts`: the reasoning (and harmony's calls) of this piece; the answer's content and calls join them."""
        if self.tools is None:
            parts.content = answer
        else:
            content, calls = self.tools.feed(answer) if answer else ("", [])
            parts.content = content
            parts.calls.extend(calls)
            if final:
                more_content, more_calls = self.tools.finish()
                parts.content += more_content
                parts.calls.extend(more_calls)
        if self.single:
            parts.calls = [d for d in parts.calls if d.index == 0]
        return parts


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallsJson:
    """Tool-call deltas of one streamed sample -> OpenAI `tool_calls` delta entries: a call's first has its id,
    type and name, the later ones only the next piece of its arguments."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def delta(self, d) -> dict[str, Any]:
        if d.name is not None:
            self.ids.append(call_id())
            return {"index": d.index, "id": self.ids[d.index], "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments}}
        return {"index": d.index, "function": {"arguments": d.arguments}}
