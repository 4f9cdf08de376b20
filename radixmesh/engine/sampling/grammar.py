"""Structured outputs through xgrammar: JSON schema, regex and EBNF constraints as per-token bitmasks.

Grammars are compiled when a request arrives, in the caller's thread (async callers: a worker thread), never on
the scheduler loop. A cache keyed by the constraint holds one future per grammar: concurrent requests for the same
grammar wait for one compilation, a request never waits for another's grammar, and an invalid one is rejected
before the request takes a batch slot. Each request gets its own matcher, advanced by every token it generates;
the scheduler asks it for the next-token bitmask. A reasoning model's constraint binds its answer only: the matcher
stands aside while the model thinks (`ConstraintMatcher`).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

from radixmesh.engine.sampling.params import SamplingParams


class GrammarCompilerCache:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr  # only engines with a tokenizer and the xgrammar backend import it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def compile(self, params: SamplingParams):
        """The compiled grammar for the request's constraint (None when it has none). Raises ValueError naming
        the field when the constraint does not compile."""
        if params.constraint is None:
            return None
        with self._lock:
            fut = self._cache.get(params.constraint)
            owner = fut is None
            if owner:
                fut = self._cache[params.constraint] = Future()
        if owner:
            try:
                fut.set_result(self._compile(*params.constraint))
            except ValueError as e:  # a bad constraint stays cached as its error
                fut.set_exception(e)
        return fut.result()

    def _compile(self, kind: str, spec: str):
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(bounded_strings_as_patterns(spec), any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with a parser message
            raise ValueError(f"invalid {kind}: {e}") from None

    def matcher(self, compiled, params: SamplingParams) -> "ConstraintMatcher":
        return ConstraintMatcher(self._xgr.GrammarMatcher(compiled), params.reasoning_end_token_id,
                                 params.reasoning_start_token_id)

    def bitmask(self, batch: int, vocab: int):
        return self._xgr.allocate_token_bitmask(batch, vocab)


class ConstraintMatcher:
    """One request's grammar, advanced by each token it generates. With `end_id` (a reasoning model's end-of-thinking
    token) the grammar binds only what follows it: the output starts in its thinking, free until `end_id` is
    sampled; with `start_id` as well it starts in its answer, under the grammar, but its first token may be
    `start_id`, which opens the thinking instead. A request that never ends its thinking is never constrained."""

    __slots__ = ("grammar", "end_id", "start_id", "state")

    def __init__(self, grammar, end_id: int | None = None, start_id: int | None = None) -> None:
        self.grammar, self.end_id, self.start_id = grammar, end_id, start_id
        # "thinking" (free), "first" (the answer's first token, or start_id), "answer" (the grammar binds)
        self.state = "answer" if end_id is None else "thinking" if start_id is None else "first"

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (the scheduler asks for a bitmask only then)."""
        return self.state != "thinking"

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        self.grammar.fill_next_token_bitmask(bitmask, row)
        if self.state == "first":
            allow_token(bitmask, row, self.start_id)

    def accept_token(self, token: int) -> bool:
        """Whether the grammar accepts `token` (anything does while thinking), as xgrammar's matcher answers."""
        if self.state == "thinking":
            if token == self.end_id:
                self.state = "answer"
            return True
        if self.state == "first":
            self.state = "answer"
            if token == self.start_id:
                self.state = "thinking"
                return True
        return self.grammar.accept_token(token)

    def is_terminated(self) -> bool:
        return self.state == "answer" and self.grammar.is_terminated()

    def fill_masks_along(self, draft: list[int], bitmask, rows: list[int]) -> list[int]:
        """For a speculative verify: row rows[j] of `bitmask` gets the mask for the token after draft[:j], as if
        those tokens had been accepted; returns the rows a mask applies to (positions in the thinking part are
        free). The matcher ends as it began (its grammar rolled back). At the first drafted token the grammar
        refuses, or after one that ends the grammar, the positions after it are left out: the target cannot
        keep the first, and a request ends with the second, so nothing after either is used."""
        state, fed, masked = self.state, 0, []
        try:
            for j, row in enumerate(rows):
                if self.active:
                    self.fill_next_token_bitmask(bitmask, row)
                    masked.append(row)
                if j == len(draft):
                    break
                token = draft[j]
                consumes = self.state == "answer" or (self.state == "first" and token != self.start_id)
                if not self.accept_token(token):
                    break
                fed += consumes
                if self.is_terminated():  # the draft ends the output here: no position after it is used
                    break
        finally:
            if fed:
                self.grammar.rollback(fed)
            self.state = state
        return masked


def allow_token(bitmask, row: int, token: int) -> None:
    """Set `token`'s bit in an xgrammar bitmask row (int32 words, 32 tokens each, low bit first)."""
    word, bit = divmod(token, 32)
    value = 1 << bit
    bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value


# One JSON string character that needs no escape (RFC 8259: not a quote, a backslash or a control character), as
# exact UTF-8: no overlong encoding, no UTF-16 surrogate, nothing above U+10FFFF. xgrammar 0.2.8 builds exact byte
# rules only for a range within one UTF-8 length, hence one alternative per length; a class whose ranges cross
# lengths also takes overlong encodings (each decodes to one U+FFFD per byte, and the length bound breaks). Code
# points above the BMP are written \u{...}: it reads \U0010ffff as the letter U and the digits. Probed byte by byte
# (tests/unit/test_bounded_strings.py); the regression test in tests/api/test_structured_outputs.py samples it.
_PLAIN_CHAR = (r"(?:[\x20-\x21\x23-\x5b\x5d-\x7f]|[\x80-\u07ff]|[\u0800-\ud7ff]|[\ue000-\uffff]"
               r"|[\u{10000}-\u{10ffff}])")
_STRING_KEYWORDS_KEPT = ("pattern", "format", "enum", "const")


def bounded_strings_as_patterns(spec: str) -> str:
    """Works around xgrammar 0.2.8, whose rule for a string bounded by minLength/maxLength admits raw control
    characters (U+0000-U+001F but the newline), which JSON forbids: such outputs fail json.loads. (Its string rules
    also take encoded surrogates, which are not UTF-8; the pattern here refuses them too.) Every string
    schema with a length bound and no pattern, format, enum or const becomes the same bounds on a pattern of
    characters that need no escape, which xgrammar compiles correctly. The bounded string loses nothing it had:
    that rule already refused escapes. `spec` is returned as it is when there is nothing to change (or it is not
    JSON: the compiler reports that)."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec
    changed = False

    def visit(node):
        nonlocal changed
        if isinstance(node, list):
            return [visit(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: visit(v) for k, v in node.items()}
        kind = out.get("type")
        is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
        lo, hi = out.get("minLength"), out.get("maxLength")
        if is_string and (lo is not None or hi is not None) and not any(k in out for k in _STRING_KEYWORDS_KEPT):
            if _is_count(lo) and _is_count(hi):
                out.pop("minLength", None)
                out.pop("maxLength", None)
                out["pattern"] = f"^{_PLAIN_CHAR}{{{lo or 0},{'' if hi is None else hi}}}$"
                changed = True
        return out

    fixed = visit(schema)
    return json.dumps(fixed) if changed else spec


def _is_count(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def apply_bitmask(logits, bitmask, rows: list[int]) -> None:
    """Set logits of tokens the grammar forbids to -inf, in place, for the listed rows."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
