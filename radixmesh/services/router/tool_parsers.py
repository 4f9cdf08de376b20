"""Tool-call parsers: a model's generated text -> OpenAI tool calls, whole (`parse`) or streamed (`feed` pieces,
then `finish`), for SGLang's `--tool-call-parser` names, plus the parsers and JSON schemas behind
tool_choice="required" and a named tool_choice.

Every parser is a state machine over the text seen so far. A state reads from `_pos`, emits content and call
deltas, and never decides anything from where the text happens to end: it waits instead (text that might be the
start of a marker is held back), and `finish` resolves every wait as end of output. `parse` runs a fresh twin over
the whole text in "whole" mode, which differs from streaming in one place only: a call is committed when its
object closes and checked with json.loads (a block that fails stays in the content as raw text), where streaming
commits as soon as the function's name is known and then forwards the raw arguments JSON piece by piece. So any
chunking of a well-formed output yields parse()'s content and calls.

JSON formats are read by ObjectScanner, an incremental scanner over one object that tracks strings, escapes and
nesting and records each top-level member's value span. The per-format parsers, and the registry of them by name
(`make_tool_parser`), live in tool_formats.py and the modules tool_call_parsers.py gathers, which build on this
module."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

WHITESPACE = " \t\r\n"
ARG_KEYS = ("arguments", "parameters")  # the member holding a call's arguments; the first present wins
_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["{}\[\]]')
_NON_SPACE = re.compile(r"[^ \t\r\n]")
_COMPACT_AT = 1 << 16  # chars of consumed text kept before a text state drops them


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int  # which call of this output: 0, 1, 2 ... in order
    name: str | None  # set on a call's first delta only
    arguments: str  # the next piece of the call's arguments JSON text


class Phase(enum.Enum):
    BEFORE = "before"  # whitespace before the opening brace
    KEY = "key"  # expecting a member's key ("}" too while the object is empty)
    IN_KEY = "in_key"
    COLON = "colon"
    VALUE = "value"  # expecting a member's value
    IN_VALUE = "in_value"  # inside a member's value: a string, a container or a bare scalar
    COMMA = "comma"  # expecting "," or "}"
    DONE = "done"
    ERROR = "error"


_STOPPED = (Phase.DONE, Phase.ERROR)


@dataclass(slots=True)
class ObjectScanner:
    """Incremental scanner over one JSON object inside a growing text, starting at `start` (whitespace may come
    first). It checks the top level's punctuation; nested values' grammar is left to json.loads. Indices are
    positions in the text passed to `advance`, which must only ever grow at its end."""

    start: int
    pos: int = -1  # next char to read
    phase: Phase = Phase.BEFORE
    depth: int = 0  # 1 inside the object, 2+ inside a member's container value
    in_string: bool = False
    escaped: bool = False
    obj_start: int = -1  # index of "{"
    end: int = -1  # index just past "}" once DONE
    key: str = ""  # the member being read
    token_start: int = -1  # where the current key or value began
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start, end) of complete values

    def __post_init__(self) -> None:
        if self.pos < 0:
            self.pos = self.start

    def advance(self, text: str) -> None:
        """Reads text[pos:], updating the phase, the spans and pos; stops at DONE or ERROR."""
        i, n = self.pos, len(text)
        while i < n and self.phase not in _STOPPED:
            if self.in_string:
                i = self._string(text, i)
            elif self.depth >= 2:
                i = self._nested(text, i)
            else:
                i = self._top(text, i)
        self.pos = i

    def value_span(self, keys: Sequence[str]) -> tuple[int, int] | None:
        """(start, end so far) of the first member among `keys`, complete or still being read."""
        for key, span in self.spans.items():
            if key in keys:
                return span
        if self.phase is Phase.IN_VALUE and self.key in keys:
            return self.token_start, self.pos
        return None

    def _string(self, text: str, i: int) -> int:
        if self.escaped:
            self.escaped = False
            return i + 1
        m = _STRING_STOP.search(text, i)
        if m is None:
            return len(text)
        j = m.start()
        if text[j] == "\\":
            self.escaped = True
        else:
            self.in_string = False
            if self.depth == 1:
                self._string_closed(text, j + 1)
        return j + 1

    def _nested(self, text: str, i: int) -> int:
        m = _NESTED_STOP.search(text, i)
        if m is None:
            return len(text)
        j = m.start()
        c = text[j]
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        else:
            self.depth -= 1
            if self.depth == 1:
                self._value_closed(j + 1)
        return j + 1

    def _top(self, text: str, i: int) -> int:
        c, phase = text[i], self.phase
        if phase is Phase.IN_VALUE:  # a bare scalar (number, true, false, null) runs to a delimiter
            if c in ",}" or c in WHITESPACE:
                self._value_closed(i)
                return i  # the delimiter is read again in the COMMA phase
            return i + 1
        if c in WHITESPACE:
            return i + 1
        if phase is Phase.BEFORE and c == "{":
            self.depth, self.obj_start, self.phase = 1, i, Phase.KEY
        elif phase is Phase.KEY and c == '"':
            self.in_string, self.token_start, self.phase = True, i, Phase.IN_KEY
        elif phase is Phase.COLON and c == ":":
            self.phase = Phase.VALUE
        elif phase is Phase.VALUE and c not in ",:]}":
            self.token_start, self.phase = i, Phase.IN_VALUE
            self.in_string = c == '"'
            self.depth = 2 if c in "{[" else 1
        elif phase is Phase.COMMA and c == ",":
            self.phase = Phase.KEY
        elif c == "}" and (phase is Phase.COMMA or (phase is Phase.KEY and not self.spans)):
            self.end, self.phase = i + 1, Phase.DONE
        else:
            self.phase = Phase.ERROR
        return i + 1

    def _string_closed(self, text: str, end: int) -> None:
        if self.phase is not Phase.IN_KEY:
            self._value_closed(end)
            return
        try:
            self.key = json.loads(text[self.token_start : end])
            self.phase = Phase.COLON
        except ValueError:
            self.phase = Phase.ERROR

    def _value_closed(self, end: int) -> None:
        self.spans.setdefault(self.key, (self.token_start, end))
        self.phase = Phase.COMMA


class Outcome(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"  # not a call: its raw text goes to the content


@dataclass(slots=True)
class PendingCall:
    scan: ObjectScanner
    name: str | None = None  # known once its "name" member is read (given up front when bare)
    bare: bool = False  # the object IS the arguments; the format gave the name
    index: int = -1  # delta index once committed (streaming)
    sent: int = -1  # text index up to which arguments were emitted (streaming)


State = Callable[[bool], bool]  # reads from _pos given `final`; True when it progressed and should run again


def tool_parameters(tool: dict) -> dict:
    """The parameters JSON schema of an OpenAI tool entry ({"type": "object"} when it has none)."""
    return (tool.get("function") or tool).get("parameters") or {"type": "object"}


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str):
    """json.loads without NaN/Infinity, which json.dumps would write back as invalid JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def held_tail(text: str, pos: int, markers: Sequence[str]) -> int:
    """Length of the longest tail of text[pos:] that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text) - pos), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class ToolCallParser:
    """One instance per generated sample: feed() and finish() keep streaming state; parse() does not touch it.
    Subclasses set `_state` to their first state in `_begin`."""

    special_markers = False  # the format's markers are special tokens: the text it reads must keep them

    def __init__(self, tools: Sequence[dict]) -> None:
        self._tool_defs = list(tools)
        self.tools: dict[str, dict] = {(t.get("function") or t)["name"]: tool_parameters(t) for t in tools}
        self._whole = False
        self._text = ""
        self._pos = 0  # text[:_pos] is consumed
        self._raw_from = 0  # where the call being read began, for its raw text if it fails
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._calls = 0  # calls committed so far
        self._call: PendingCall | None = None
        self._found: dict[str, tuple[int, int, int]] = {}  # marker -> (first index >= start or -1, start, text length)
        self._then: State = self._pass_through  # the state after the current call
        self._state: State = self._begin()

    def _begin(self) -> State:
        raise NotImplementedError

    def _twin(self) -> ToolCallParser:
        return type(self)(self._tool_defs)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole output -> (content outside the calls, calls). Leaves this parser's streaming state alone."""
        twin = self._twin()
        twin._whole = True
        head, first = twin.feed(text)
        tail, rest = twin.finish()
        return head + tail, [ToolCall(d.name or "", d.arguments) for d in first + rest]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Appends the next piece of output; returns the content now safe to emit and the new call deltas."""
        self._text += text
        while self._state(False):
            pass
        return self._drain()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: resolves what was held back (text that never became a call is content)."""
        while self._state(True):
            pass
        self._emit(self._text[self._pos :])
        self._pos = len(self._text)
        return self._drain()

    def _drain(self) -> tuple[str, list[ToolCallDelta]]:
        merged: list[ToolCallDelta] = []
        for d in self._deltas:  # one delta per call per piece: join a call's consecutive argument pieces
            if merged and d.name is None and merged[-1].index == d.index:
                last = merged.pop()
                d = ToolCallDelta(d.index, last.name, last.arguments + d.arguments)
            merged.append(d)
        content = "".join(self._content)
        self._content.clear()
        self._deltas.clear()
        return content, merged

    # --- helpers for states -------------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _skip_space(self, i: int) -> int:
        m = _NON_SPACE.search(self._text, i)
        return m.start() if m else len(self._text)

    def _compact(self) -> None:
        """Drops consumed text; only text states call it, when no index into the text is live."""
        if self._pos >= _COMPACT_AT:
            self._text = self._text[self._pos :]
            self._pos = 0
            self._found.clear()

    def _scan_text(self, markers: Sequence[str], final: bool) -> tuple[int, str] | None:
        """Emits content up to the first marker and returns (its index, it); without one, emits all but a tail
        that might start a marker (all of it when final) and returns None."""
        self._compact()
        text, pos = self._text, self._pos
        found = min(((i, m) for m in markers if (i := self._find(m)) >= 0), default=None)
        stop = found[0] if found else len(text) - (0 if final else held_tail(text, pos, markers))
        self._emit(text[pos:stop])
        self._pos = stop
        return found

    def _find(self, marker: str) -> int:
        """text.find(marker, _pos), remembering earlier answers so that whole mode does not rescan long text."""
        pos = self._pos
        at, start, searched = self._found.get(marker, (-1, pos + 1, 0))
        if start > pos or at < pos:
            if start <= pos and at < 0:  # no match from start to the old end: search only the text since
                begin = max(pos, searched - len(marker) + 1)
            else:
                begin = start = pos
            at, searched = self._text.find(marker, begin), len(self._text)
            self._found[marker] = (at, start, searched)
        return at

    def _waiting(self, j: int, final: bool, *prefixes_of: str) -> bool:
        """True when text[j:] is too short to tell: empty or a proper prefix of one of `prefixes_of`."""
        rest = self._text[j : j + max(map(len, prefixes_of), default=1)]
        return not final and (not rest or any(len(rest) < len(p) and p.startswith(rest) for p in prefixes_of))

    # --- shared states ------------------------------------------------------------------------------------

    def _pass_through(self, final: bool) -> bool:
        self._compact()
        self._emit(self._text[self._pos :])
        self._pos = len(self._text)
        return False

    def _fail(self) -> bool:
        """The call being read is not one: its raw text and everything after it are content."""
        self._pos, self._state = self._raw_from, self._pass_through
        return True

    def _trailing(self, final: bool) -> bool:
        """After the last call: whitespace is dropped, anything else is content."""
        j = self._skip_space(self._pos)
        self._pos = j
        if j < len(self._text):
            self._state = self._pass_through
        return j < len(self._text)

    def _start_call(self, call: PendingCall, then: State) -> bool:
        self._call, self._then, self._pos, self._state = call, then, call.scan.start, self._in_call
        return True

    def _in_call(self, final: bool) -> bool:
        call = self._call
        outcome = self._advance_call(call, final)
        if outcome is Outcome.PENDING:
            return False
        if outcome is Outcome.FAILED:
            return self._fail()
        scan = call.scan  # a call cut short by a syntax error ends before the offending char
        self._pos = scan.end if scan.end >= 0 else scan.pos - 1 if scan.phase is Phase.ERROR else len(self._text)
        self._raw_from, self._call, self._state = self._pos, None, self._then
        return True

    # --- reading one call object ----------------------------------------------------------------------------

    def _advance_call(self, call: PendingCall, final: bool) -> Outcome:
        scan = call.scan
        scan.advance(self._text)
        if call.name is None and "name" in scan.spans:
            try:
                name = loads_strict(self._text[slice(*scan.spans["name"])])
            except ValueError:
                return Outcome.FAILED
            if not isinstance(name, str) or name not in self.tools:
                return Outcome.FAILED
            call.name = name
        if not self._whole and scan.phase is not Phase.ERROR:
            self._stream_arguments(call)
        if scan.phase is Phase.ERROR or (final and scan.phase is not Phase.DONE):
            if call.index < 0:
                return Outcome.FAILED
            if call.sent < 0:  # a committed call stays, cut short
                self._deltas.append(ToolCallDelta(call.index, None, "{}"))
            return Outcome.DONE
        if scan.phase is not Phase.DONE:
            return Outcome.PENDING
        return self._close_call(call)

    def _stream_arguments(self, call: PendingCall) -> None:
        scan = call.scan
        if call.name is None or scan.obj_start < 0:
            return
        if call.bare:
            span = (scan.obj_start, scan.end if scan.phase is Phase.DONE else scan.pos)
        else:
            span = scan.value_span(ARG_KEYS)
        piece = ""
        if span is not None:
            start = max(span[0], call.sent)
            piece, call.sent = self._text[start : span[1]], span[1]
        if call.index < 0:
            call.index, self._calls = self._calls, self._calls + 1
            self._deltas.append(ToolCallDelta(call.index, call.name, piece))
        elif piece:
            self._deltas.append(ToolCallDelta(call.index, None, piece))

    def _close_call(self, call: PendingCall) -> Outcome:
        if call.name is None:
            return Outcome.FAILED
        if not self._whole:
            if call.sent < 0:  # no arguments member: an empty arguments object
                self._deltas.append(ToolCallDelta(call.index, None, "{}"))
            return Outcome.DONE
        try:
            obj = loads_strict(self._text[call.scan.obj_start : call.scan.end])
        except ValueError:
            return Outcome.FAILED
        if not call.bare:
            obj = next((obj[k] for k in obj if k in ARG_KEYS), {})
        if not isinstance(obj, dict):
            return Outcome.FAILED
        self._deltas.append(ToolCallDelta(self._calls, call.name, json.dumps(obj, ensure_ascii=False)))
        self._calls += 1
        return Outcome.DONE


def required_calls_schema(tools: Sequence[dict], parallel: bool) -> dict:
    """JSON schema for tool_choice="required": an array of one call (several when parallel) to any tool."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": (t.get("function") or t)["name"]}, "parameters": tool_parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_call_schema(tool: dict) -> dict:
    """JSON schema for a named tool_choice: the tool's parameters."""
    return tool_parameters(tool)
