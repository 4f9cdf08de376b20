"""Structured outputs through xgrammar: JSON schema, regex and EBNF constraints as per-token bitmasks.

Grammars are compiled when a request arrives, in the caller's thread (async callers: a worker thread), never on
the scheduler loop. A cache keyed by the constraint holds one future per grammar: concurrent requests for the same
grammar wait for one compilation, a request never waits for another's grammar, and an invalid one is rejected
before the request takes a batch slot. Each request gets its own matcher, advanced by every token it generates;
the scheduler asks it for the next-token bitmask.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from engine.sampling.params import SamplingParams


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
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with a parser message
            raise ValueError(f"invalid {kind}: {e}") from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int, vocab: int):
        return self._xgr.allocate_token_bitmask(batch, vocab)


def apply_bitmask(logits, bitmask, rows: list[int]) -> None:
    """Set logits of tokens the grammar forbids to -inf, in place, for the listed rows."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
