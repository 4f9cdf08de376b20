"""GPT-OSS's output format ("harmony"): SGLang's `--reasoning-parser gpt-oss` and `--tool-call-parser gpt-oss`.

GPT-OSS writes a sequence of messages, each a header and a body:

    <|channel|>analysis<|message|>The user wants the weather. I should call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the prompt ends with `<|start|>assistant`, so the first header has no role). A body ends at `<|end|>`, `<|call|>` or
`<|return|>` (the last two are stop tokens: usually the end of the output), or where the next header begins. The
markers are special tokens, so the router asks the worker to keep special tokens in the text of a request parsed
here (`keeps_special_tokens`).

Where each body goes: the `analysis` channel is reasoning (content when reasoning is not split); a message to
`functions.NAME` (the recipient in its header, on the channel or the role) is a call of NAME when NAME is one of the
request's tools; everything else (the `final` channel, `commentary` preambles, recipients that are no tool of the
request, text outside any header: a constrained answer is plain JSON) is content.

`HarmonySplitter` reads the text streamed (any chunking gives the whole text's result: a possible partial marker is
held back, a header is read only once its `<|message|>` arrived) or whole. Streamed, a call is announced with its
name as soon as its header is complete and its arguments follow piece by piece as written; whole, a call is kept only
when its body is a JSON object, else the body is content (as every tool-call format does with a broken call)."""

from __future__ import annotations

import json
import re

from radixmesh.services.router.tool_formats import register
from radixmesh.services.router.tool_parsers import ToolCall, ToolCallDelta, ToolCallParser, held_tail, loads_strict

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN = "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)  # a body's own terminators, consumed with it
_HEADS = (START, CHANNEL)  # a header beginning: it also ends a body left open
_MARKERS = _ENDS + _HEADS
_HEADER_LIMIT = 512  # characters of a header without its <|message|>: beyond this it is text, not a header
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_][\w.-]*)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."
ANALYSIS = "analysis"


class HarmonySplitter:
    """One sample's harmony output -> reasoning, content and tool calls (module docstring).

    `split_reasoning`: the analysis channel is reasoning (else content); `tools`: the request's tool names -> their
    parameters schemas, whose calls are read (None: calls are content); `in_analysis`: the prompt opened an analysis
    body, which the output continues; `whole`: commit calls only when their JSON parses (ToolCallParser.parse)."""

    def __init__(self, split_reasoning: bool, tools: dict[str, dict] | None, in_analysis: bool = False,
                 whole: bool = False) -> None:
        self.split_reasoning, self.tools, self.whole = split_reasoning, tools, whole
        self.pending = ""
        self.mode = "body" if in_analysis else "between"  # between -> header -> body -> between ...
        self.channel: str | None = ANALYSIS if in_analysis else None
        self.recipient: str | None = None
        self.thought = in_analysis  # an analysis message was seen (even an empty one)
        self.calls = 0
        self.call: tuple[int, str] | None = None  # (index, name) of the call whose body is being read
        self.body = ""  # the body so far of a call read whole (committed once it parses)
        self.sent = False  # a streamed call sent arguments other than spaces
        self._out: tuple[list[str], list[str], list[ToolCallDelta]] = ([], [], [])

    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        """The next piece of output -> (reasoning, content, call deltas) now certain."""
        self.pending += text
        while self.pending and self._step(final=False):
            pass
        return self._drain()

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        """End of output: what was held back is resolved (a header never completed is content)."""
        while self.pending and self._step(final=True):
            pass
        if self.mode == "body":
            self._close()
        return self._drain()

    def _drain(self) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content, deltas = self._out
        out = "".join(reasoning), "".join(content), list(deltas)
        for part in self._out:
            part.clear()
        return out

    # --- states -------------------------------------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        """Reads from `pending` in the current mode; True when it progressed and should run again."""
        if self.mode == "between":
            return self._between(final)
        if self.mode == "header":
            return self._header(final)
        return self._body(final)

    def _between(self, final: bool) -> bool:
        """Before a message: a header, or text outside any (content)."""
        text = self.pending
        if text.startswith(_HEADS):
            self.mode = "header"
            return True
        if not final and any(h.startswith(text) for h in _HEADS):
            return False  # could still become a header
        self.mode, self.channel, self.recipient = "body", None, None
        return True

    def _header(self, final: bool) -> bool:
        text = self.pending
        at = text.find(MESSAGE)
        if at > _HEADER_LIMIT or (at < 0 and (final or len(text) > _HEADER_LIMIT)):
            # not a header after all: its marker is content, and so is the text up to the next marker
            marker = START if text.startswith(START) else CHANNEL
            self._out[1].append(marker)
            self.pending, self.mode, self.channel, self.recipient = text[len(marker):], "body", None, None
            return True
        if at < 0:
            return False
        header, self.pending = text[:at], text[at + len(MESSAGE):]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else None
        self.recipient = recipient.group(1) if recipient else None
        self.mode = "body"
        self._open()
        return True

    def _body(self, final: bool) -> bool:
        text = self.pending
        found = min(((i, m) for m in _MARKERS if (i := text.find(m)) >= 0), default=None)
        if found is None:
            keep = 0 if final else held_tail(text, 0, _MARKERS)
            self._write(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            return False
        at, marker = found
        self._write(text[:at])
        self.pending = text[at + len(marker):] if marker in _ENDS else text[at:]
        self._close()
        self.mode = "between"
        return True

    # --- where a body goes ----------------------------------------------------------------------------------

    def _open(self) -> None:
        """A body begins: an analysis message counts as thought, a call to a tool is announced (streamed)."""
        if self.channel == ANALYSIS:
            self.thought = True
        name = self.recipient[len(FUNCTIONS):] if self.recipient and self.recipient.startswith(FUNCTIONS) else None
        if self.channel != ANALYSIS and self.tools is not None and name in self.tools:
            self.call, self.body, self.sent = (self.calls, name), "", False
            if not self.whole:
                self._out[2].append(ToolCallDelta(self.calls, name, ""))
                self.calls += 1

    def _write(self, text: str) -> None:
        if not text:
            return
        if self.call is not None:
            if self.whole:
                self.body += text
            else:
                self.sent = self.sent or bool(text.strip())
                self._out[2].append(ToolCallDelta(self.call[0], None, text))
        elif self.channel == ANALYSIS and self.split_reasoning:
            self._out[0].append(text)
        else:
            self._out[1].append(text)

    def _close(self) -> None:
        """A body ended: a call is committed (whole: when its body is a JSON object, else the body is content)."""
        if self.call is None:
            return
        index, name = self.call
        self.call = None
        if not self.whole:
            if not self.sent:  # no arguments written: an empty object
                self._out[2].append(ToolCallDelta(index, None, "{}"))
            return
        try:
            args = loads_strict(self.body) if self.body.strip() else {}
        except ValueError:
            args = None
        if isinstance(args, dict):
            self._out[2].append(ToolCallDelta(self.calls, name, json.dumps(args, ensure_ascii=False)))
            self.calls += 1
        else:
            self._out[1].append(self.body)


def split_harmony(text: str, split_reasoning: bool, tools: dict[str, dict] | None,
                  in_analysis: bool = False) -> tuple[str | None, str, list[ToolCall]]:
    """A whole output -> (reasoning or None when there was no analysis message, content, calls)."""
    splitter = HarmonySplitter(split_reasoning, tools, in_analysis, whole=True)
    r1, c1, d1 = splitter.feed(text)
    r2, c2, d2 = splitter.finish()
    reasoning = r1 + r2 if split_reasoning and splitter.thought else None
    return reasoning, c1 + c2, [ToolCall(d.name or "", d.arguments) for d in d1 + d2]


@register("gpt-oss")
class HarmonyToolParser(ToolCallParser):
    """`--tool-call-parser gpt-oss` without `--reasoning-parser gpt-oss`: calls read from the harmony messages, every
    other body (the analysis too) content. (With the reasoning parser, chat_output's SampleParser runs one
    HarmonySplitter for both.)"""

    special_markers = True

    def _begin(self):
        self._splitter = HarmonySplitter(False, self.tools)
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        _, content, calls = split_harmony(text, False, self.tools)
        return content, calls

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        _, content, deltas = self._splitter.feed(text)
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        _, content, deltas = self._splitter.finish()
        return content, deltas
