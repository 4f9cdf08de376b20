"""The per-format tool-call parsers, registered under SGLang's `--tool-call-parser` names (see tool_parsers.py for
the state-machine conventions they follow).

  qwen25 (qwen, hermes)  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, blocks between text
  llama3                 {"name": "f", "parameters": {...}}; {...}  as the whole output or after <|python_tag|>
  mistral                [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]  or  [TOOL_CALLS]f[ARGS]{...}
  pythonic               [f(a=1, b="x"), g()]  optionally inside <|python_start|> ... <|python_end|>

The JSON formats stream each call's arguments as they arrive; pythonic emits each call whole once its list closes
(read with `ast`, never evaluated). RequiredCallsParser and NamedCallParser read the constrained outputs of
tool_choice="required" and of a named tool_choice. Every format module files its parsers here (`register`);
tool_call_parsers.py imports them all and makes one by name."""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from radixmesh.services.router.tool_parsers import (
    ObjectScanner,
    PendingCall,
    State,
    ToolCallDelta,
    ToolCallParser,
    held_tail,
)

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {}


def register(*names: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Class decorator: files the parser under each of SGLang's `--tool-call-parser` names."""

    def add(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        for name in names:
            TOOL_CALL_PARSERS[name] = cls
        return cls

    return add


QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_CALLS_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_CALLS_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")


class CallArrayParser(ToolCallParser):
    """Shared states for a JSON array of call objects; `_after_array` is where the closing "]" leads."""

    def _array_item(self, final: bool) -> bool:
        """Inside a JSON array of call objects, before an item (an empty array is not a list of calls)."""
        j = self._skip_space(self._pos)
        if self._waiting(j, final):
            return False
        if self._text.startswith("{", j):
            return self._start_call(PendingCall(ObjectScanner(j)), self._array_sep)
        return self._fail()

    def _array_sep(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._waiting(j, final):
            return False
        c = self._text[j : j + 1]
        if c == ",":
            self._pos, self._state = j + 1, self._array_item
        elif c == "]":
            self._pos, self._state = j + 1, self._after_array
        else:
            return self._fail()
        return True

    def _after_array(self, final: bool) -> bool:
        self._state = self._trailing
        return True


class RequiredCallsParser(CallArrayParser):
    """tool_choice="required": the output IS a JSON array of {"name", "parameters"} objects
    (required_calls_schema); each item is a call. Text that is not is content."""

    def _begin(self) -> State:
        return self._open

    def _open(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._waiting(j, final):
            return False
        if self._text[j : j + 1] != "[":
            return self._fail()
        self._pos, self._state = j + 1, self._array_item
        return True


class NamedCallParser(ToolCallParser):
    """A named tool_choice: the output IS the arguments object of one call to `name`."""

    def __init__(self, tools: Sequence[dict], name: str) -> None:
        self.name = name
        super().__init__(tools)
        if name not in self.tools:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")

    def _twin(self) -> ToolCallParser:
        return type(self)(self._tool_defs, name=self.name)

    def _begin(self) -> State:
        return self._open

    def _open(self, final: bool) -> bool:
        return self._start_call(PendingCall(ObjectScanner(self._pos), name=self.name, bare=True), self._trailing)


class TagBlocks(ToolCallParser):
    """Formats of `<tool_call>` ... `</tool_call>` blocks (qwen25 here; glm45 and qwen3_coder in
    tool_formats_tagged.py), whose text state is `_in_text`: a block that is not a call is content up to and
    including its closing marker, and a closing marker takes one newline after it."""

    def _raw_block(self, final: bool) -> bool:
        text, pos = self._text, self._pos
        j = self._find(QWEN_CLOSE)
        stop = j + len(QWEN_CLOSE) if j >= 0 else len(text) - (0 if final else held_tail(text, pos, (QWEN_CLOSE,)))
        self._emit(text[pos:stop])
        self._pos = stop
        if j >= 0:
            self._state = self._in_text
        return j >= 0

    def _after_close(self, final: bool) -> bool:
        if self._pos == len(self._text) and not final:
            return False
        if self._text.startswith("\n", self._pos):
            self._pos += 1
        self._state = self._in_text
        return True


@register("qwen25", "qwen", "hermes")
class Qwen25Parser(TagBlocks):
    """Blocks of one JSON call each. The newline before an opening marker and the one after a closing marker go
    with the markers. A block that is not a call is content up to and including its closing marker."""

    def _begin(self) -> State:
        return self._in_text

    def _in_text(self, final: bool) -> bool:
        found = self._scan_text(("\n" + QWEN_OPEN, QWEN_OPEN), final)
        if found is None:
            return False
        i, marker = found
        self._raw_from = i
        return self._start_call(PendingCall(ObjectScanner(i + len(marker))), self._after_object)

    def _fail(self) -> bool:
        self._pos, self._state = self._raw_from, self._raw_block
        return True

    def _after_object(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._text.startswith(QWEN_CLOSE, j):
            self._pos, self._state = j + len(QWEN_CLOSE), self._after_close
            return True
        if self._waiting(j, final, QWEN_CLOSE):
            return False
        self._pos, self._state = j, self._in_text
        return True



@register("llama3")
class Llama3Parser(ToolCallParser):
    """JSON calls ("parameters" or "arguments") separated by ";", as the whole output or after <|python_tag|>
    (text before the tag is content). Output that does not start with a call or the tag is content."""

    def _begin(self) -> State:
        return self._at_start

    def _at_start(self, final: bool) -> bool:
        return self._call_or_text(self._skip_space(self._pos), final)

    def _call_or_text(self, j: int, final: bool) -> bool:
        """At j (after whitespace): a call, the tag, or content from _raw_from on."""
        if self._waiting(j, final, PYTHON_TAG):
            return False
        if self._text.startswith("{", j):
            return self._start_call(PendingCall(ObjectScanner(j)), self._after_call)
        if self._text.startswith(PYTHON_TAG, j):
            self._pos, self._state = j + len(PYTHON_TAG), self._after_tag
            return True
        self._pos, self._state = self._raw_from, self._in_text
        return True

    def _in_text(self, final: bool) -> bool:
        found = self._scan_text((PYTHON_TAG,), final)
        if found is None:
            return False
        self._raw_from = found[0]
        self._pos, self._state = found[0] + len(PYTHON_TAG), self._after_tag
        return True

    def _after_tag(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._waiting(j, final):
            return False
        if self._text.startswith("{", j):
            return self._start_call(PendingCall(ObjectScanner(j)), self._after_call)
        return self._fail()

    def _after_call(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._waiting(j, final):
            return False
        if self._text.startswith(";", j):
            self._raw_from, self._pos, self._state = j, j + 1, self._after_semicolon
        else:
            self._pos, self._state = j, self._in_text
        return True

    def _after_semicolon(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if final and j == len(self._text):  # a ";" that ends the output only separated
            self._pos = j
            return False
        return self._call_or_text(j, final)


@register("mistral")
class MistralParser(CallArrayParser):
    """[TOOL_CALLS] then a JSON array of calls (or one call object), or the newer [TOOL_CALLS]name[ARGS]{...}.
    Text before the marker and after the calls is content."""

    def _begin(self) -> State:
        return self._in_text

    def _in_text(self, final: bool) -> bool:
        found = self._scan_text((MISTRAL_CALLS,), final)
        if found is None:
            return False
        self._raw_from = found[0]
        self._pos, self._state = found[0] + len(MISTRAL_CALLS), self._after_marker
        return True

    def _after_marker(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._waiting(j, final):
            return False
        c = self._text[j : j + 1]
        if c == "[":
            self._pos, self._state = j + 1, self._array_item
            return True
        if c == "{":
            return self._start_call(PendingCall(ObjectScanner(j)), self._in_text)
        if _NAME.match(c):
            self._pos, self._state = j, self._in_name
            return True
        return self._fail()

    def _in_name(self, final: bool) -> bool:
        text = self._text
        k = _NAME.match(text, self._pos).end()
        if text.startswith(MISTRAL_ARGS, k):
            name = text[self._pos : k]
            if name not in self.tools:
                return self._fail()
            call = PendingCall(ObjectScanner(k + len(MISTRAL_ARGS)), name=name, bare=True)
            return self._start_call(call, self._in_text)
        if self._waiting(k, final, MISTRAL_ARGS):
            return False
        return self._fail()

    def _after_array(self, final: bool) -> bool:
        self._state = self._in_text
        return True


@dataclass(slots=True)
class ListScan:
    """Finds the "]" closing a Python list in a growing text: tracks brackets and string literals."""

    pos: int  # next char to read; the list's "[" is read first
    depth: int = 0
    quote: str = ""  # the open string's quote (', ", ''' or \"\"\"), "" outside strings
    escaped: bool = False

    def advance(self, text: str, final: bool) -> int | None:
        """Index just past the closing "]", or None while the list is open (pos is then where to resume)."""
        i, n = self.pos, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif text.startswith(self.quote, i):
                    i, self.quote = i + len(self.quote), ""
                    continue
                elif len(self.quote) == 3 and c == self.quote[0] and n - i < 3 and not final:
                    break  # maybe the first quote of the closing three
                i += 1
                continue
            if c in "'\"":
                if text.startswith(c * 3, i):
                    self.quote, i = c * 3, i + 3
                    continue
                if not final and n - i < 3 and (c * 3).startswith(text[i:]):
                    break  # one or two quotes at the end: maybe an opening triple quote
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
            i += 1
        self.pos = i
        return None


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST):
    """A Python literal's value as JSON data; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, bool, int, float)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not finite")
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("object keys must be strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if type(value) not in (int, float):
            raise ValueError("sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"not a literal: {type(node).__name__}")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return None


def pythonic_calls(source: str, tools: dict[str, dict]) -> list[tuple[str, str]] | None:
    """`[f(a=1), g()]` -> [(name, arguments JSON)], or None unless every item is a keyword-only call to a tool
    with literal arguments."""
    try:
        body = ast.parse(source, mode="eval").body
        if not isinstance(body, ast.List) or not body.elts:
            return None
        calls = []
        for node in body.elts:
            name = _dotted(node.func) if isinstance(node, ast.Call) else None
            if name not in tools or node.args or any(kw.arg is None for kw in node.keywords):
                return None
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords}
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


@register("pythonic")
class PythonicParser(ToolCallParser):
    """A Python list of calls anywhere in the text; the <|python_start|>/<|python_end|> tokens are dropped. A list
    that does not parse as calls to known tools is content."""

    def _begin(self) -> State:
        self._list = ListScan(0)
        return self._in_text

    def _in_text(self, final: bool) -> bool:
        found = self._scan_text(("[", PYTHON_START, PYTHON_END), final)
        if found is None:
            return False
        i, marker = found
        self._pos, self._state = (i, self._at_bracket) if marker == "[" else (i + len(marker), self._in_text)
        return True

    def _at_bracket(self, final: bool) -> bool:
        text, i = self._text, self._pos
        if _CALLS_START.match(text, i):
            self._list, self._state = ListScan(i), self._in_list
            return True
        if not final and _CALLS_PREFIX.match(text, i).end() == len(text):
            return False
        self._emit("[")
        self._pos, self._state = i + 1, self._in_text
        return True

    def _in_list(self, final: bool) -> bool:
        end = self._list.advance(self._text, final)
        if end is None:
            if final:
                self._state = self._pass_through
            return final
        source = self._text[self._pos : end]
        calls = pythonic_calls(source, self.tools)
        if calls is None:
            self._emit(source)
        for name, arguments in calls or ():
            self._deltas.append(ToolCallDelta(self._calls, name, arguments))
            self._calls += 1
        self._pos, self._state = end, self._in_text
        return True
