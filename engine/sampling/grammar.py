"""Structured outputs through xgrammar: JSON schema, regex and EBNF constraints as per-token bitmasks.

Grammars are compiled in the caller's thread when a request arrives (never on the scheduler loop), with a cache
keyed by the constraint, so an invalid one is rejected before the request takes a batch slot. Each request gets
its own matcher, advanced by every token it generates; the scheduler asks it for the next-token bitmask.
"""

from __future__ import annotations

import threading

from engine.sampling.params import SamplingParams

STRUCTURED_FIELDS = ("json_schema", "regex", "ebnf")


class GrammarCompilerCache:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr  # only engines with a tokenizer and the xgrammar backend import it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()

    def compile(self, params: SamplingParams):
        """The compiled grammar for the request's constraint (None when it has none). Raises ValueError naming
        the field when the constraint does not compile."""
        kind, spec = params.constraint or (None, None)
        if kind is None:
            return None
        with self._lock:
            if (kind, spec) not in self._cache:
                self._cache[(kind, spec)] = self._compile(kind, spec)
            return self._cache[(kind, spec)]

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

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
