"""Tool-call formats of the mixture-of-experts families, under SGLang's `--tool-call-parser` names:

  deepseekv3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
               then \\n<｜tool▁call▁begin｜>... for each further call, and <｜tool▁calls▁end｜>  (DeepSeek-V3, R1)
  deepseekv31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
  kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
               <|tool_call_end|>...<|tool_calls_section_end|>
  glm45, glm   <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>  (GLM-4.5, 4.6)
  qwen3_coder  <tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n...</function>\\n</tool_call>

The first three are sections of calls whose arguments are JSON objects, delimited by special tokens of their
tokenizers (`special_markers`): text outside a section is content, and each call's arguments stream as they arrive.
A call that is not one (a name that is no tool, arguments that are no JSON object) is content as written, its
section's opening marker with it when it is the section's first call (and then the closing one too).

The last two are blocks of XML-like tags, like qwen25's (the newline before an opening marker and the one after a
closing marker go with the markers). Their argument values are text: a value stays text unless the tool's parameter
schema gives it another type, and then it is decoded when its text is JSON (or a Python literal, which Qwen3-Coder's
chat template writes for lists and booleans) of that type. As no JSON text is written that could be forwarded piece
by piece, a streamed call is announced with its name as soon as that is read and its arguments object follows whole
when the call closes; whole, the call comes complete when it closes. A block that is not a call is content up to and
including its closing marker."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from radixmesh.services.router.tool_formats import QWEN_CLOSE, QWEN_OPEN, TagBlocks, register
from radixmesh.services.router.tool_parsers import (
    ObjectScanner,
    PendingCall,
    State,
    ToolCallDelta,
    ToolCallParser,
    loads_strict,
)

DS_SECTION_BEGIN, DS_SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_FENCE_OPEN, DS_FENCE_CLOSE = "```json", "```"
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
QC_FUNCTION, QC_FUNCTION_END = "<function=", "</function>"
QC_PARAMETER, QC_PARAMETER_END = "<parameter=", "</parameter>"

NAME_LIMIT = 256  # characters of a function or parameter name: a longer run is not one
_NAME = re.compile(r"\s*([^\s<`]{0,%d})\s*" % NAME_LIMIT)  # a name (maybe empty) and the whitespace around it
_TAG_NAME = re.compile(r"\s*([^\s<>]{0,%d})\s*" % NAME_LIMIT)  # the same inside a tag, up to its ">"
_KIMI_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")  # functions.NAME:INDEX
_MISS = ("", "", -1)  # _read: the text does not fit
_JSON_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object"}


# --- argument values of the XML-like formats ----------------------------------------------------------------------


def _direct_types(schema) -> set[str]:
    """The JSON types a schema names by `type`, or, without one, those of its `enum` values."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    enum = schema.get("enum")
    return {_JSON_TYPES.get(type(v), "string") for v in enum} if isinstance(enum, list) else set()


def schema_types(schema) -> set[str]:
    """The JSON types a parameter's schema allows, its anyOf/oneOf/allOf branches' included (empty: untyped)."""
    types = _direct_types(schema)
    if isinstance(schema, dict):
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            for branch in branches if isinstance(branches, list) else ():
                types |= _direct_types(branch)
    return types


def _json_data(value):
    """A Python literal's value as JSON data (tuples become lists); ValueError when it has no JSON form."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_data(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_data(v) for k, v in value.items()}
    raise ValueError(f"no JSON form for {type(value).__name__}")


def _python_literal(text: str):
    return _json_data(ast.literal_eval(text))


def _fits(value, types: set[str]) -> bool:
    """Whether a decoded value is of one of `types` and has a JSON text (no NaN or infinity anywhere)."""
    kind = _JSON_TYPES.get(type(value))
    if not (kind in types or (kind == "integer" and "number" in types)):
        return False
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def typed_value(text: str, schema) -> object:
    """An XML-like format's argument text -> its JSON value: the text itself for a parameter whose schema allows a
    string or gives no type; else the text decoded as JSON or as a Python literal, the first of one of the schema's
    types, and the text itself when neither is."""
    types = schema_types(schema)
    if not types or "string" in types:
        return text
    stripped = text.strip()
    for decode in (loads_strict, _python_literal):
        try:
            value = decode(stripped)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
        if _fits(value, types):
            return value
    return text


def parameter_schema(parameters: dict, key: str):
    """The schema of one parameter of a tool's parameters schema (None when it has none)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties.get(key) if isinstance(properties, dict) else None


# --- shared reading ------------------------------------------------------------------------------------------------


class _TaggedParser(ToolCallParser):
    """What the formats here share: reading a name and the marker after it."""

    def _read(self, at: int, token: re.Pattern, final: bool, *markers: str) -> tuple[str, str, int] | None:
        """`token` (whose one group may be empty) at `at`, then one of `markers`: (the group, the marker, the index
        past it); None while the text so far could still become that; _MISS when it cannot."""
        text = self._text
        m = token.match(text, at)
        j = m.end()
        for marker in markers:
            if text.startswith(marker, j):
                return m.group(1), marker, j + len(marker)
        return None if self._waiting(j, final, *markers) else _MISS


# --- sections of JSON calls ----------------------------------------------------------------------------------------


class _SectionParser(_TaggedParser):
    """Sections of calls between special-token markers (module docstring); subclasses read a call's header from
    `_pos` (just past its CALL_BEGIN) in `_header` and hand its arguments object to `_open_arguments`."""

    special_markers = True
    SECTION_BEGIN = SECTION_END = CALL_BEGIN = CALL_END = ""
    TRAILER: tuple[str, ...] = ()  # what may come between a call's arguments object and its CALL_END

    def _begin(self) -> State:
        self._call_at = -1  # index of the CALL_BEGIN of the call being read
        self._section_calls = 0  # self._calls when the section began
        self._raw_section = False  # a call failed before any of the section's calls was taken: its end is content
        return self._in_text

    def _header(self, final: bool) -> bool:
        raise NotImplementedError

    def _in_text(self, final: bool) -> bool:
        found = self._scan_text((self.SECTION_BEGIN, self.CALL_BEGIN), final)
        if found is None:
            return False
        i, marker = found
        self._raw_from, self._pos = i, i + len(marker)
        self._raw_section, self._section_calls = False, self._calls
        if marker == self.CALL_BEGIN:  # a call outside any section
            self._call_at, self._state = i, self._header
        else:
            self._state = self._first_call
        return True

    def _first_call(self, final: bool) -> bool:
        """Just past the section's opening marker: its first call (without one, the marker is content)."""
        j = self._skip_space(self._pos)
        if self._text.startswith(self.CALL_BEGIN, j):
            self._call_at, self._pos, self._state = j, j + len(self.CALL_BEGIN), self._header
            return True
        if self._waiting(j, final, self.CALL_BEGIN):
            return False
        self._emit(self._text[self._raw_from : self._pos])
        self._state = self._in_text
        return True

    def _between(self, final: bool) -> bool:
        """Inside a section after a call: the next call or the section's end; other text ends the section."""
        text = self._text
        j = self._skip_space(self._pos)
        if text.startswith(self.CALL_BEGIN, j):
            self._raw_from = self._call_at = j
            self._pos, self._state = j + len(self.CALL_BEGIN), self._header
            return True
        if text.startswith(self.SECTION_END, j):
            end = j + len(self.SECTION_END)
            if self._raw_section:
                self._emit(text[self._pos : end])
            self._raw_section, self._pos, self._state = False, end, self._in_text
            return True
        if self._waiting(j, final, self.CALL_BEGIN, self.SECTION_END):
            return False
        self._raw_section, self._pos, self._state = False, j, self._in_text
        return True

    def _open_arguments(self, name: str, at: int) -> bool:
        """The header named `name`; its arguments object starts at `at` (after whitespace)."""
        if name not in self.tools:
            return self._fail()
        return self._start_call(PendingCall(ObjectScanner(at), name=name, bare=True), self._after_arguments)

    def _after_arguments(self, final: bool) -> bool:
        text = self._text
        j = self._skip_space(self._pos)
        for part in self.TRAILER:
            if text.startswith(part, j):
                j = self._skip_space(j + len(part))
            elif self._waiting(j, final, part):
                return False
        if text.startswith(self.CALL_END, j):
            self._pos, self._state = j + len(self.CALL_END), self._between
            return True
        if self._waiting(j, final, self.CALL_END):
            return False
        self._pos, self._state = j, self._between  # a call left open: what follows decides
        return True

    def _fail(self) -> bool:
        """The call being read is not one: its raw text is content (_raw_call), with the section's opening marker
        when it is the section's first call, and then the section's end too, whatever calls follow."""
        head = self._call_at + len(self.CALL_BEGIN)
        self._raw_section = self._raw_section or self._calls == self._section_calls
        self._emit(self._text[self._raw_from : head])
        self._call, self._pos, self._state = None, head, self._raw_call
        return True

    def _raw_call(self, final: bool) -> bool:
        """Content up to the next call or the section's end (what the failed call left is its text)."""
        found = self._scan_text((self.CALL_END, self.CALL_BEGIN, self.SECTION_END), final)
        if found is None:
            return False
        i, marker = found
        if marker == self.CALL_END:
            self._emit(marker)
            self._pos = i + len(marker)
        else:
            self._pos, self._state = i, self._between
        return True


@register("deepseekv3")
class DeepSeekV3Parser(_SectionParser):
    """DeepSeek-V3 and R1: `function<｜tool▁sep｜>NAME`, then the arguments in a ```json fence."""

    SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END = DS_SECTION_BEGIN, DS_SECTION_END, DS_CALL_BEGIN, DS_CALL_END
    TRAILER = (DS_FENCE_CLOSE,)

    def _header(self, final: bool) -> bool:
        got = self._read(self._pos, _NAME, final, DS_SEP)
        if got is None:
            return False
        if got is _MISS or got[0] != "function":
            return self._fail()
        got = self._read(got[2], _NAME, final, DS_FENCE_OPEN)
        if got is None:
            return False
        return self._fail() if got is _MISS else self._open_arguments(got[0], got[2])


@register("deepseekv31")
class DeepSeekV31Parser(_SectionParser):
    """DeepSeek-V3.1: `NAME<｜tool▁sep｜>` then the bare arguments object."""

    SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END = DS_SECTION_BEGIN, DS_SECTION_END, DS_CALL_BEGIN, DS_CALL_END

    def _header(self, final: bool) -> bool:
        got = self._read(self._pos, _NAME, final, DS_SEP)
        if got is None:
            return False
        return self._fail() if got is _MISS else self._open_arguments(got[0], got[2])


@register("kimi_k2")
class KimiK2Parser(_SectionParser):
    """Kimi-K2: a call id `functions.NAME:INDEX` (the index counts the output's calls), then the arguments."""

    SECTION_BEGIN, SECTION_END = KIMI_SECTION_BEGIN, KIMI_SECTION_END
    CALL_BEGIN, CALL_END = KIMI_CALL_BEGIN, KIMI_CALL_END

    def _header(self, final: bool) -> bool:
        got = self._read(self._pos, _NAME, final, KIMI_ARGUMENTS)
        if got is None:
            return False
        m = _KIMI_ID.fullmatch(got[0])
        return self._open_arguments(m.group(1), got[2]) if got is not _MISS and m else self._fail()


# --- blocks of XML-like tags ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class XmlCall:
    name: str
    parameters: dict  # the tool's parameters schema, which types the values
    arguments: dict = field(default_factory=dict)
    index: int = -1  # delta index once announced (streaming)


class _BlockParser(_TaggedParser, TagBlocks):
    """<tool_call> blocks of tags (module docstring); subclasses read a block from `_pos` (just past its opening
    marker) in `_block`, opening its call with `_open_call` and ending it with `_end_call`."""

    def _begin(self) -> State:
        self._xml: XmlCall | None = None
        self._key = ""  # the argument whose value is being read
        return self._in_text

    def _block(self, final: bool) -> bool:
        raise NotImplementedError

    def _in_text(self, final: bool) -> bool:
        found = self._scan_text(("\n" + QWEN_OPEN, QWEN_OPEN), final)
        if found is None:
            return False
        i, marker = found
        self._raw_from, self._pos, self._state = i, i + len(marker), self._block
        return True

    def _open_call(self, name: str, at: int, then: State) -> bool:
        """The call's name is read (its arguments follow at `at`): announced at once when streamed."""
        if name not in self.tools:
            return self._fail()
        self._xml = XmlCall(name, self.tools[name])
        if not self._whole:
            self._xml.index, self._calls = self._calls, self._calls + 1
            self._deltas.append(ToolCallDelta(self._xml.index, name, ""))
        self._pos, self._state = at, then
        return True

    def _set_argument(self, text: str) -> None:
        call = self._xml
        call.arguments[self._key] = typed_value(text, parameter_schema(call.parameters, self._key))

    def _end_call(self, at: int, then: State) -> bool:
        """The call closes: its arguments object (with its name too in whole mode)."""
        call, self._xml = self._xml, None
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        if call.index < 0:
            call.index, self._calls = self._calls, self._calls + 1
            self._deltas.append(ToolCallDelta(call.index, call.name, arguments))
        else:
            self._deltas.append(ToolCallDelta(call.index, None, arguments))
        self._pos, self._state = at, then
        return True

    def _broken(self, at: int) -> bool:
        """The block stops fitting the format at `at`. Whole, or before its name is announced, it is no call; once
        announced (streaming), the call ends with the arguments read so far and the rest is text."""
        if self._xml is None or self._xml.index < 0:
            return self._fail()
        return self._end_call(at, self._in_text)

    def _fail(self) -> bool:
        self._xml, self._pos, self._state = None, self._raw_from, self._raw_block
        return True

    def _first_of(self, *markers: str) -> tuple[int, str] | None:
        """The first of `markers` from `_pos`: (its index, it); None when there is none yet."""
        return min(((i, m) for m in markers if (i := self._find(m)) >= 0), default=None)


@register("glm45", "glm")
class Glm45Parser(_BlockParser):
    """GLM-4.5/4.6: `<tool_call>NAME`, then <arg_key>/<arg_value> pairs (any whitespace between tags), then
    `</tool_call>`."""

    def _block(self, final: bool) -> bool:
        got = self._read(self._pos, _NAME, final, GLM_KEY, QWEN_CLOSE)
        if got is None:
            return False
        return self._fail() if got is _MISS else self._open_call(got[0], got[2] - len(got[1]), self._pairs)

    def _pairs(self, final: bool) -> bool:
        """Before the next pair or the block's end."""
        text = self._text
        j = self._skip_space(self._pos)
        if text.startswith(GLM_KEY, j):
            self._pos, self._state = j + len(GLM_KEY), self._key_text
            return True
        if text.startswith(QWEN_CLOSE, j):
            return self._end_call(j + len(QWEN_CLOSE), self._after_close)
        if self._waiting(j, final, GLM_KEY, QWEN_CLOSE):
            return False
        return self._broken(j)

    def _key_text(self, final: bool) -> bool:
        """A key: at most NAME_LIMIT characters before its </arg_key> (a longer run is no key)."""
        i, limit = self._find(GLM_KEY_END), self._pos + NAME_LIMIT
        if 0 <= i <= limit:
            self._key = self._text[self._pos : i].strip()
            self._pos, self._state = i + len(GLM_KEY_END), self._value_open
            return True
        if i < 0 and not final and len(self._text) < limit + len(GLM_KEY_END):
            return False
        return self._broken(self._pos)

    def _value_open(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if self._text.startswith(GLM_VALUE, j):
            self._pos, self._state = j + len(GLM_VALUE), self._value_text
            return True
        return False if self._waiting(j, final, GLM_VALUE) else self._broken(j)

    def _value_text(self, final: bool) -> bool:
        i = self._find(GLM_VALUE_END)
        if i < 0:
            return self._broken(self._pos) if final else False
        self._set_argument(self._text[self._pos : i])
        self._pos, self._state = i + len(GLM_VALUE_END), self._pairs
        return True


@register("qwen3_coder")
class Qwen3CoderParser(_BlockParser):
    """Qwen3-Coder: `<function=NAME>` blocks (one or more per <tool_call>) of `<parameter=KEY>` values, each between
    one newline after its tag and one before its end (a value missing its </parameter> ends at the next tag)."""

    def _block(self, final: bool) -> bool:
        j = self._skip_space(self._pos)
        if not self._text.startswith(QC_FUNCTION, j):
            return False if self._waiting(j, final, QC_FUNCTION) else self._fail()
        got = self._read(j + len(QC_FUNCTION), _TAG_NAME, final, ">")
        if got is None:
            return False
        return self._fail() if got is _MISS else self._open_call(got[0], got[2], self._parameters)

    def _parameters(self, final: bool) -> bool:
        """Before the next parameter or the function's end."""
        text = self._text
        j = self._skip_space(self._pos)
        if text.startswith(QC_PARAMETER, j):
            got = self._read(j + len(QC_PARAMETER), _TAG_NAME, final, ">")
            if got is None:
                return False
            if got is _MISS:
                return self._broken(j)
            self._key, self._pos, self._state = got[0], got[2], self._value_text
            return True
        if text.startswith(QC_FUNCTION_END, j):
            return self._end_call(j + len(QC_FUNCTION_END), self._after_function)
        return False if self._waiting(j, final, QC_PARAMETER, QC_FUNCTION_END) else self._broken(j)

    def _value_text(self, final: bool) -> bool:
        found = self._first_of(QC_PARAMETER_END, QC_PARAMETER, QC_FUNCTION_END)
        if found is None:
            return self._broken(self._pos) if final else False
        i, marker = found
        value = self._text[self._pos : i]
        value = value[1:] if value.startswith("\n") else value
        self._set_argument(value[:-1] if value.endswith("\n") else value)
        self._pos = i + len(marker) if marker == QC_PARAMETER_END else i  # an end that is another tag is read next
        self._state = self._parameters
        return True

    def _after_function(self, final: bool) -> bool:
        """Past </function>: the block's end, or another function in the same block."""
        text = self._text
        j = self._skip_space(self._pos)
        if text.startswith(QWEN_CLOSE, j):
            self._pos, self._state = j + len(QWEN_CLOSE), self._after_close
        elif text.startswith(QC_FUNCTION, j):
            self._raw_from, self._pos, self._state = j, j, self._block
        elif self._waiting(j, final, QWEN_CLOSE, QC_FUNCTION):
            return False
        else:
            self._pos, self._state = j, self._in_text  # a block left open: what follows is text
        return True
